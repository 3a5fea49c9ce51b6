// Framework-free tensor views passed between the layers (no ownership).
#pragma once

#include <cstdint>
#include <string>

namespace detlogp {

enum class DType : uint8_t { bf16, f32, i32, i64 };
enum class Memory : uint8_t { host, cuda };

const char* dtype_name(DType d);
int dtype_size(DType d);

// Up to 2-D, row-major with an explicit row stride (elements). A 1-D view has cols == 1 and
// describes a contiguous vector of `rows` elements. data == nullptr means "absent".
struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;
  int64_t rows = 0;
  int64_t cols = 1;
  int64_t row_stride = 0;  // elements; == cols when contiguous
  Memory memory = Memory::host;
  int device = 0;

  bool present() const { return data != nullptr || ndim != 0; }
  static TensorView matrix(const void* p, DType t, int64_t r, int64_t c, Memory m = Memory::host, int64_t stride = -1) {
    return {p, t, 2, r, c, stride < 0 ? c : stride, m, 0};
  }
  static TensorView vector(const void* p, DType t, int64_t n, Memory m = Memory::host) {
    return {p, t, 1, n, 1, 1, m, 0};
  }
  static TensorView scalar(const void* p, DType t, Memory m = Memory::host) { return {p, t, 0, 1, 1, 1, m, 0}; }
};

struct MutableTensorView : TensorView {
  void* mutable_data() const { return const_cast<void*>(data); }
};

inline MutableTensorView mutable_matrix(void* p, DType t, int64_t r, int64_t c, Memory m = Memory::host) {
  return {TensorView::matrix(p, t, r, c, m)};
}
inline MutableTensorView mutable_vector(void* p, DType t, int64_t n, Memory m = Memory::host) {
  return {TensorView::vector(p, t, n, m)};
}

}  // namespace detlogp
