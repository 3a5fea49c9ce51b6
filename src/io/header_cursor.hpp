// The read position in a file header's text that the .npy and safetensors header parsers share:
// whitespace, expected characters, bracketed comma-separated lists and dict keys, and the error
// that names the file and the byte of the header where parsing stopped.
#pragma once

#include <set>
#include <string>
#include <string_view>

#include "detlogp/error.hpp"

namespace detlogp::io {

class HeaderCursor {
 protected:
  // `malformed` says what is wrong with a header that fails to parse, e.g. "header is not valid JSON".
  HeaderCursor(std::string_view text, const std::string& source, const char* malformed)
      : text_(text), source_(source), malformed_(malformed) {}

  [[noreturn]] void fail(const std::string& what) const {
    DETLOGP_FAIL("'" << source_ << "': " << malformed_ << " at byte " << pos_ << " of the header: " << what);
  }
  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return at_end() ? '\0' : text_[pos_]; }
  void skip_whitespace() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) ++pos_;
  }
  void expect(char c, const char* context) {
    if (peek() != c) fail(std::string("expected '") + c + "' " + context);
    ++pos_;
  }
  void expect_end(const char* what_is_left) {
    skip_whitespace();
    if (pos_ != text_.size()) fail(what_is_left);
  }

  enum class TrailingComma { rejected, allowed };  // JSON rejects "[1,]"; Python literals allow it

  // A list that opens with `open` at pos_ and holds items separated by ',' up to `close`; `read_item`
  // reads one item, starting at its first non-blank character.
  template <class ReadItem>
  void read_list(char open, const char* open_context, char close, const char* close_context, TrailingComma trailing,
                 ReadItem read_item) {
    expect(open, open_context);
    for (bool first = true;; first = false) {
      skip_whitespace();
      if ((first || trailing == TrailingComma::allowed) && peek() == close) {
        ++pos_;
        return;
      }
      read_item();
      skip_whitespace();
      if (peek() != ',') break;
      ++pos_;
    }
    expect(close, close_context);
  }

  struct Key {
    std::string text;
    size_t offset;  // where the key starts, for errors about it
  };

  // One "key:" of a dict, read by `read_key`; a key already in `seen` fails where it starts.
  // `quote` encloses the key in that error.
  template <class ReadKey>
  Key read_key(ReadKey read_key, std::set<std::string>& seen, char quote, const char* colon_context) {
    Key key{{}, pos_};
    key.text = read_key();
    if (!seen.insert(key.text).second) {
      pos_ = key.offset;
      fail(std::string("duplicate key ") + quote + key.text + quote);
    }
    skip_whitespace();
    expect(':', colon_context);
    skip_whitespace();
    return key;
  }

  std::string_view text_;
  const std::string& source_;
  const char* malformed_;
  size_t pos_ = 0;
};

}  // namespace detlogp::io
