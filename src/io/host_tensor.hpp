// Tensors of the file formats (safetensors, .npy): an owned, host-resident HostTensor as read
// from or written to a file, and a TensorRef that views bytes someone else holds (a mapped file).
#pragma once

#include <bit>
#include <cstdint>
#include <iterator>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "detlogp/error.hpp"

namespace detlogp::io {

// The file formats store little-endian bytes; the tensors are used in place, without swapping.
static_assert(std::endian::native == std::endian::little, "detlogp's file I/O assumes a little-endian host");

// Element types the file layer understands. U8 serves the partials output (target_owned); F16,
// F64 and BOOL are read only so that a tensor of those types is refused by name, as the library
// refuses a wrong dtype, instead of as an unreadable file.
enum class ElementType : uint8_t { bf16, f32, i32, i64, u8, f16, f64, boolean };

// Per element type: its safetensors dtype name, its size in bytes, the .npy descr the writer uses
// and its array-library name (numpy's, bfloat16 as ml_dtypes and torch call it), the words the
// Python faces use for a dtype.
struct ElementTypeInfo {
  ElementType type;
  const char* name;
  int size;
  const char* npy_descr;
  const char* array_name;
};

// In enum order, so a type's entry is kElementTypes[type].
inline constexpr ElementTypeInfo kElementTypes[] = {
    {ElementType::bf16, "BF16", 2, "<u2", "bfloat16"}, {ElementType::f32, "F32", 4, "<f4", "float32"},
    {ElementType::i32, "I32", 4, "<i4", "int32"},      {ElementType::i64, "I64", 8, "<i8", "int64"},
    {ElementType::u8, "U8", 1, "|u1", "uint8"},        {ElementType::f16, "F16", 2, "<f2", "float16"},
    {ElementType::f64, "F64", 8, "<f8", "float64"},    {ElementType::boolean, "BOOL", 1, "|b1", "bool"},
};
static_assert([] {
  for (size_t i = 0; i < std::size(kElementTypes); ++i)
    if (kElementTypes[i].type != static_cast<ElementType>(i)) return false;
  return true;
}());

// The entry of `t`; a value outside the enum gets name and descr "?" and size 0.
inline const ElementTypeInfo& element_type_info(ElementType t) {
  static constexpr ElementTypeInfo kUnknown{ElementType::u8, "?", 0, "?", "?"};
  const auto index = static_cast<size_t>(t);
  return index < std::size(kElementTypes) ? kElementTypes[index] : kUnknown;
}

inline const char* element_type_name(ElementType t) { return element_type_info(t).name; }
inline int element_size(ElementType t) { return element_type_info(t).size; }
inline const char* element_type_array_name(ElementType t) { return element_type_info(t).array_name; }

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

// A tensor whose bytes live elsewhere (a mapped file, a buffer being parsed); valid while they do.
struct TensorRef {
  ElementType dtype = ElementType::f32;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;

  int64_t element_count() const { return checked_element_count(shape); }
  const void* data() const { return bytes.data(); }

  HostTensor copy() const {
    HostTensor t;
    t.dtype = dtype;
    t.shape = shape;
    t.bytes.assign(bytes.begin(), bytes.end());
    return t;
  }
};

}  // namespace detlogp::io
