// An owned, host-resident tensor as read from or written to a file (safetensors, .npy), and
// the whole-file read / atomic write helpers both formats share.
#pragma once

#include <unistd.h>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

#include "detlogp/error.hpp"

namespace detlogp::io {

// The file formats store little-endian bytes; the tensors are used in place, without swapping.
static_assert(std::endian::native == std::endian::little, "detlogp's file I/O assumes a little-endian host");

// Element types the file layer understands. U8 only serves the partials output (target_owned).
enum class ElementType : uint8_t { bf16, f32, i32, i64, u8 };

// Per element type: its safetensors dtype name, its size in bytes and the .npy descr the writer uses.
struct ElementTypeInfo {
  ElementType type;
  const char* name;
  int size;
  const char* npy_descr;
};

// In enum order, so a type's entry is kElementTypes[type].
inline constexpr ElementTypeInfo kElementTypes[] = {
    {ElementType::bf16, "BF16", 2, "<u2"}, {ElementType::f32, "F32", 4, "<f4"}, {ElementType::i32, "I32", 4, "<i4"},
    {ElementType::i64, "I64", 8, "<i8"},   {ElementType::u8, "U8", 1, "|u1"},
};
static_assert([] {
  for (size_t i = 0; i < std::size(kElementTypes); ++i)
    if (kElementTypes[i].type != static_cast<ElementType>(i)) return false;
  return true;
}());

// The entry of `t`; a value outside the enum gets name and descr "?" and size 0.
inline const ElementTypeInfo& element_type_info(ElementType t) {
  static constexpr ElementTypeInfo kUnknown{ElementType::u8, "?", 0, "?"};
  const auto index = static_cast<size_t>(t);
  return index < std::size(kElementTypes) ? kElementTypes[index] : kUnknown;
}

inline const char* element_type_name(ElementType t) { return element_type_info(t).name; }
inline int element_size(ElementType t) { return element_type_info(t).size; }

inline std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  s += "]";
  return s;
}

// Product of the dimensions, or -1 when a dimension is negative or the product overflows int64.
inline int64_t checked_element_count(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && count > INT64_MAX / d) return -1;
    count *= d;
  }
  return count;
}

// C-order tensor; bytes are the raw little-endian element values. An empty shape is a scalar.
struct HostTensor {
  ElementType dtype = ElementType::f32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  int64_t element_count() const { return checked_element_count(shape); }
  // The vector's storage comes from operator new, aligned for any element type here.
  const void* data() const { return bytes.data(); }
  void* data() { return bytes.data(); }

  static HostTensor zeros(ElementType dtype, std::vector<int64_t> shape) {
    HostTensor t;
    t.dtype = dtype;
    t.shape = std::move(shape);
    const int64_t count = t.element_count();
    DETLOGP_CHECK(count >= 0, "invalid tensor shape " << shape_to_string(t.shape));
    t.bytes.assign(static_cast<size_t>(count) * static_cast<size_t>(element_size(dtype)), 0);
    return t;
  }
};

// Whole file into memory; the error names the file.
inline std::vector<uint8_t> read_file_bytes(const std::filesystem::path& path) {
  std::error_code ec;
  DETLOGP_CHECK(std::filesystem::is_regular_file(path, ec),
                "cannot read '" << path.string() << "': not a regular file");
  std::ifstream in(path, std::ios::binary);
  DETLOGP_CHECK(in, "cannot open '" << path.string() << "' for reading");
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  DETLOGP_CHECK(size >= 0, "cannot determine the size of '" << path.string() << "'");
  in.seekg(0, std::ios::beg);
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  if (size > 0) in.read(reinterpret_cast<char*>(bytes.data()), size);
  DETLOGP_CHECK(in.good() || (size == 0 && !in.bad()), "error reading '" << path.string() << "'");
  return bytes;
}

// Writes to a temporary file in the same directory, then renames it over `path`: readers see the
// old file or the complete new one, and a failed write leaves nothing behind.
inline void write_file_atomically(const std::filesystem::path& path, const std::vector<uint8_t>& bytes) {
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  std::error_code ec;
  DETLOGP_CHECK(std::filesystem::is_directory(dir, ec),
                "cannot write '" << path.string() << "': directory '" << dir.string() << "' does not exist");
  DETLOGP_CHECK(!std::filesystem::is_directory(path, ec), "cannot write '" << path.string() << "': it is a directory");
  std::string tmp_name = ".";
  tmp_name += path.filename().string();
  tmp_name += ".tmp-";
  tmp_name += std::to_string(static_cast<long>(::getpid()));
  const std::filesystem::path tmp = dir / tmp_name;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    DETLOGP_CHECK(out, "cannot create temporary file '" << tmp.string() << "'");
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      std::filesystem::remove(tmp, ec);
      DETLOGP_FAIL("error writing '" << tmp.string() << "' (disk full?)");
    }
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    DETLOGP_FAIL("cannot rename '" << tmp.string() << "' to '" << path.string() << "': " << ec.message());
  }
}

}  // namespace detlogp::io
