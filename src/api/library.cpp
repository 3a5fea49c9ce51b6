// What the library is and how it is set up: its version, its backends, its environment knobs.
#include "core/device_ops.hpp"
#include "core/env.hpp"
#include "detlogp/detlogp.hpp"
#include "registry/registry.hpp"

namespace detlogp {

std::string version_string() { return DETLOGP_VERSION; }

std::vector<BackendInfo> list_backends() {
  std::vector<BackendInfo> out;
  for (const detail::Backend* b : detail::all_backends()) {
    BackendInfo info;
    info.id = b->id();
    info.contract_bearing = b->contract_bearing();
    info.available = b->available(&info.detail);
    info.memory = b->memory();
    info.provenance = b->provenance();
    info.multi_targets = b->supports_multi_targets();
    info.topk = b->supports_topk();
    out.push_back(info);
  }
  return out;
}

void check_environment() { detail::check_environment(); }

void check_deferred_errors() { detail::drain_deferred_device_errors(); }

}  // namespace detlogp
