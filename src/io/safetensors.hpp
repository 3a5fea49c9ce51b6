// safetensors reader and writer (format: docs/file-formats.md).
//
// Reading validates the whole file before any tensor is handed out and throws detlogp::Error
// naming the file and the offending field: file size, header length, header JSON (a strict
// parser for the subset safetensors uses), dtype, shape x dtype size vs byte range, offsets in
// bounds, no overlaps and no unindexed bytes. map_safetensors leaves the tensors in the mapped
// file (a large input costs its size once, not twice); read/parse copy them out. Writing is
// deterministic: the same tensors and metadata always give the same bytes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "io/file.hpp"
#include "io/host_tensor.hpp"

namespace detlogp::io {

struct NamedTensor {
  std::string name;
  HostTensor tensor;
};

struct SafetensorsContents {
  std::vector<NamedTensor> tensors;             // read: in data-offset order
  std::map<std::string, std::string> metadata;  // the optional "__metadata__" string map

  const HostTensor* find(std::string_view name) const;
  void add(std::string name, HostTensor tensor);
};

struct NamedTensorRef {
  std::string name;
  TensorRef tensor;
};

// The tensors of a file as views into its bytes, in data-offset order, and its metadata.
struct SafetensorsRefs {
  std::vector<NamedTensorRef> tensors;
  std::map<std::string, std::string> metadata;

  const TensorRef* find(std::string_view name) const;
};

// A mapped file and the views into it; the views stay valid while `file` lives.
struct MappedSafetensors {
  std::shared_ptr<const MappedFile> file;
  SafetensorsRefs contents;
};

// Limit on the JSON header (the reference implementation uses the same 100 MB bound).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// `source` names the bytes in error messages (usually the file path). index_safetensors returns
// views into `file_bytes`; parse_safetensors copies the tensors out.
SafetensorsRefs index_safetensors(std::span<const uint8_t> file_bytes, const std::string& source);
SafetensorsContents parse_safetensors(std::span<const uint8_t> file_bytes, const std::string& source);
MappedSafetensors map_safetensors(const std::filesystem::path& path);
SafetensorsContents read_safetensors(const std::filesystem::path& path);

// Canonical layout: tensors ordered by element size (largest first, so every tensor's data is
// aligned to its element size) then by name; header JSON without whitespace, "__metadata__"
// first when present, then tensors in data order; header padded with spaces to a multiple of 8.
std::vector<uint8_t> serialize_safetensors(const SafetensorsContents& contents);
// Atomic (write_file_atomically): missing directories are created, a failed write leaves nothing.
void write_safetensors(const std::filesystem::path& path, const SafetensorsContents& contents);

}  // namespace detlogp::io
