// The project's one JSON string escape, shared by the safetensors writer (whose canonical header
// bytes depend on it) and the validation reports.
#pragma once

#include <string>

namespace detlogp::io {

// `s` as a JSON string literal, quotes included: the minimal escapes (\" \\ \n \r \t \b \f) and
// \u00xx (lower-case hex) for the other control characters; every other byte, UTF-8 included,
// is copied as is.
std::string json_quote(const std::string& s);

}  // namespace detlogp::io
