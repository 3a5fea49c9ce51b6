// Helpers shared by the io tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "detlogp/error.hpp"
#include "io/host_tensor.hpp"

namespace detlogp::io::testing {

// Runs fn, which must throw detlogp::Error whose message contains every one of `needles`.
template <class Fn>
void expect_error(Fn&& fn, std::initializer_list<const char*> needles) {
  try {
    fn();
  } catch (const detlogp::Error& e) {
    const std::string message = e.what();
    for (const char* needle : needles) {
      EXPECT_NE(message.find(needle), std::string::npos) << "message lacks \"" << needle << "\": " << message;
    }
    return;
  }
  ADD_FAILURE() << "expected a detlogp::Error";
}

template <class T>
std::vector<uint8_t> bytes_of(const std::vector<T>& values) {
  std::vector<uint8_t> out(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

inline HostTensor make_tensor(ElementType dtype, std::vector<int64_t> shape, std::vector<uint8_t> bytes) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes = std::move(bytes);
  return t;
}

}  // namespace detlogp::io::testing
