// Errors: every failed check throws detlogp::Error carrying file:line and a message that names
// the offending argument and its value.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace detlogp {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
[[noreturn]] inline void throw_error(const char* file, int line, const std::string& message) {
  std::ostringstream os;
  os << "detlogp error at " << file << ":" << line << ": " << message;
  throw Error(os.str());
}
}  // namespace detail

}  // namespace detlogp

// DETLOGP_CHECK(cond, stream-expression): throws with file:line when cond is false.
#define DETLOGP_CHECK(cond, msg)                                             \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::ostringstream detlogp_os_;                                        \
      detlogp_os_ << msg;                                                    \
      ::detlogp::detail::throw_error(__FILE__, __LINE__, detlogp_os_.str()); \
    }                                                                        \
  } while (0)

#define DETLOGP_FAIL(msg) DETLOGP_CHECK(false, msg)
