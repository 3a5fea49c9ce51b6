// NumPy .npy reader and writer (format versions 1.0, 2.0 and 3.0; docs/file-formats.md).
//
// Element types: '<f4' (F32), '<i4' (I32), '<i8' (I64), '|u1' (U8) and bf16. NumPy has no bf16
// type, so by convention a 2-byte element that is not a float ('<u2', '<i2', or raw void '|V2')
// carries the bf16 bit pattern; the writer uses '<u2'. Only C order: fortran_order True is
// rejected. Reading validates everything (magic, version, header dict, descr, shape, exact data
// size) and throws detlogp::Error naming the file and the field. map_npy leaves the data in the
// mapped file; read/parse copy it out.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "io/file.hpp"
#include "io/host_tensor.hpp"

namespace detlogp::io {

// A mapped .npy file and the view of its data; the view stays valid while `file` lives.
struct MappedNpy {
  std::shared_ptr<const MappedFile> file;
  TensorRef tensor;
};

// `source` names the bytes in error messages. index_npy returns a view into `file_bytes`.
TensorRef index_npy(std::span<const uint8_t> file_bytes, const std::string& source);
HostTensor parse_npy(std::span<const uint8_t> file_bytes, const std::string& source);
MappedNpy map_npy(const std::filesystem::path& path);
HostTensor read_npy(const std::filesystem::path& path);

// Header padded so the data starts at a multiple of 64 bytes (NumPy's own writer does the same).
std::vector<uint8_t> serialize_npy(const HostTensor& tensor);
// Atomic (write_file_atomically): missing directories are created, a failed write leaves nothing.
void write_npy(const std::filesystem::path& path, const HostTensor& tensor);

}  // namespace detlogp::io
