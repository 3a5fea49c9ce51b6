// What the CPU backends share: host memory, always available, a provenance fixed at construction.
#pragma once

#include <string>
#include <utility>

#include "core/backend.hpp"

namespace detlogp::detail {

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(Provenance provenance) : prov_(std::move(provenance)) {}
  const Provenance& provenance() const final { return prov_; }
  Memory memory() const final { return Memory::host; }
  bool available(std::string*) const final { return true; }

 private:
  Provenance prov_;
};

}  // namespace detlogp::detail
