#include "io/npy.hpp"

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>

#include "io/header_cursor.hpp"

namespace detlogp::io {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

// The header is a Python dict literal such as
//   {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
// This parser accepts exactly that grammar: quoted keys, and as values a quoted string,
// True/False, or a tuple of non-negative integers (an 'L' suffix from Python 2 writers allowed).
class NpyHeaderParser : HeaderCursor {
 public:
  NpyHeaderParser(std::string_view text, const std::string& source)
      : HeaderCursor(text, source, "npy header is malformed") {}

  struct Header {
    std::string descr;
    bool fortran_order = false;
    std::vector<int64_t> shape;
  };

  Header parse() {
    Header h;
    std::set<std::string> seen;
    skip_whitespace();
    read_list('{', "at the start of the header dict", '}', "or ',' in the header dict", TrailingComma::allowed, [&] {
      const Key key = read_key([&] { return parse_quoted(); }, seen, '\'', "after a header key");
      if (key.text == "descr") {
        h.descr = parse_quoted();
      } else if (key.text == "fortran_order") {
        h.fortran_order = parse_bool();
      } else if (key.text == "shape") {
        h.shape = parse_shape();
      } else {
        pos_ = key.offset;
        fail("unknown key '" + key.text + "' (expected descr, fortran_order, shape)");
      }
    });
    expect_end("unexpected characters after the header dict");
    for (const char* required : {"descr", "fortran_order", "shape"}) {
      DETLOGP_CHECK(seen.count(required), "'" << source_ << "': npy header lacks the key '" << required << "'");
    }
    return h;
  }

 private:
  std::string parse_quoted() {
    const char quote = peek();
    if (quote != '\'' && quote != '"') fail("expected a quoted string");
    ++pos_;
    std::string out;
    while (true) {
      if (at_end()) fail("unterminated string");
      const char c = text_[pos_++];
      if (c == quote) return out;
      if (c == '\\') fail("escapes are not used in npy headers");
      out += c;
    }
  }

  bool parse_bool() {
    if (text_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (text_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    fail("fortran_order must be True or False");
  }

  std::vector<int64_t> parse_shape() {
    std::vector<int64_t> shape;
    read_list('(', "to open the shape tuple", ')', "or ',' in the shape tuple", TrailingComma::allowed, [&] {
      if (!(peek() >= '0' && peek() <= '9')) fail("shape must be a tuple of non-negative integers");
      int64_t value = 0;
      while (peek() >= '0' && peek() <= '9') {
        const int digit = peek() - '0';
        if (value > (INT64_MAX - digit) / 10) fail("shape dimension does not fit in 64 bits");
        value = value * 10 + digit;
        ++pos_;
      }
      if (peek() == 'L') ++pos_;
      shape.push_back(value);
      skip_whitespace();
      // "(n)" is an int in Python, not a tuple: a one-element tuple is written "(n,)".
      if (shape.size() == 1 && peek() != ',') fail("a one-element shape tuple needs a trailing comma: (n,)");
    });
    return shape;
  }
};

ElementType descr_to_type(const std::string& descr, const std::string& source) {
  if (descr == "<f4") return ElementType::f32;
  if (descr == "<i4") return ElementType::i32;
  if (descr == "<i8") return ElementType::i64;
  if (descr == "|u1" || descr == "<u1" || descr == "u1") return ElementType::u8;
  // IEEE half, not bf16: a 0-d temperature takes it, every other tensor refuses it.
  if (descr == "<f2") return ElementType::f16;
  if (descr == "<f8") return ElementType::f64;
  if (descr == "|b1" || descr == "<b1" || descr == "b1") return ElementType::boolean;
  // bf16 convention: a 2-byte non-float element carries the bf16 bit pattern.
  if (descr == "<u2" || descr == "<i2" || descr == "|V2" || descr == "<V2" || descr == "V2") return ElementType::bf16;
  if (!descr.empty() && descr[0] == '>')
    DETLOGP_FAIL("'" << source << "': descr '" << descr << "' is big-endian; only little-endian data is supported");
  DETLOGP_FAIL("'" << source << "': descr '" << descr
                   << "' is not supported (supported: '<f4', '<i4', '<i8', '|u1', '<f2', '<f8', '|b1', and bf16 as "
                      "'<u2', '<i2' or '|V2')");
}

}  // namespace

TensorRef index_npy(std::span<const uint8_t> file_bytes, const std::string& source) {
  const size_t size = file_bytes.size();
  DETLOGP_CHECK(size >= kMagicLen + 2 && std::memcmp(file_bytes.data(), kMagic, kMagicLen) == 0,
                "'" << source << "': not an .npy file (missing the \\x93NUMPY magic)");
  const int major = file_bytes[6], minor = file_bytes[7];
  DETLOGP_CHECK((major == 1 || major == 2 || major == 3) && minor == 0,
                "'" << source << "': npy format version " << major << "." << minor
                    << " is not supported (supported: 1.0, 2.0, 3.0)");
  const size_t length_bytes = major == 1 ? 2 : 4;
  const size_t prefix = kMagicLen + 2 + length_bytes;
  DETLOGP_CHECK(size >= prefix, "'" << source << "': file too short (" << size << " bytes) for an npy header length");
  uint64_t header_len = 0;
  for (size_t i = length_bytes; i-- > 0;) header_len = (header_len << 8) | file_bytes[kMagicLen + 2 + i];
  DETLOGP_CHECK(header_len <= size - prefix, "'" << source << "': npy header length " << header_len
                                                 << " is larger than the rest of the file (" << size - prefix
                                                 << " bytes); truncated file?");
  const std::string_view header(reinterpret_cast<const char*>(file_bytes.data() + prefix), header_len);
  DETLOGP_CHECK(!header.empty() && header.back() == '\n', "'" << source << "': npy header must end with a newline");

  const NpyHeaderParser::Header h = NpyHeaderParser(header, source).parse();
  DETLOGP_CHECK(!h.fortran_order, "'" << source
                                      << "': fortran_order is True; only C-order arrays are supported "
                                         "(save with np.ascontiguousarray)");
  TensorRef t;
  t.dtype = descr_to_type(h.descr, source);
  t.shape = h.shape;
  const int64_t count = t.element_count();
  DETLOGP_CHECK(count >= 0, "'" << source << "': shape " << shape_to_string(t.shape) << " has too many elements");
  const uint64_t data_size = size - prefix - header_len;
  const int elem = element_size(t.dtype);
  DETLOGP_CHECK(static_cast<uint64_t>(count) <= UINT64_MAX / static_cast<uint64_t>(elem),
                "'" << source << "': shape " << shape_to_string(t.shape) << " has too many elements");
  const uint64_t expected = static_cast<uint64_t>(count) * static_cast<uint64_t>(elem);
  DETLOGP_CHECK(data_size == expected, "'" << source << "': shape " << shape_to_string(t.shape) << " x '" << h.descr
                                           << "' needs " << expected << " data bytes, the file holds " << data_size);
  t.bytes = file_bytes.subspan(prefix + header_len, data_size);
  return t;
}

HostTensor parse_npy(std::span<const uint8_t> file_bytes, const std::string& source) {
  return index_npy(file_bytes, source).copy();
}

MappedNpy map_npy(const std::filesystem::path& path) {
  MappedNpy m;
  m.file = std::make_shared<const MappedFile>(path);
  m.tensor = index_npy(m.file->bytes(), path.string());
  return m;
}

HostTensor read_npy(const std::filesystem::path& path) {
  const MappedFile file(path);
  return parse_npy(file.bytes(), path.string());
}

std::vector<uint8_t> serialize_npy(const HostTensor& tensor) {
  const int64_t count = tensor.element_count();
  DETLOGP_CHECK(count >= 0, "npy writer: invalid shape " << shape_to_string(tensor.shape));
  DETLOGP_CHECK(tensor.bytes.size() == static_cast<size_t>(count) * static_cast<size_t>(element_size(tensor.dtype)),
                "npy writer: tensor holds " << tensor.bytes.size() << " bytes, shape " << shape_to_string(tensor.shape)
                                            << " needs " << count * element_size(tensor.dtype));
  std::string header =
      std::string("{'descr': '") + element_type_info(tensor.dtype).npy_descr + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < tensor.shape.size(); ++i) {
    if (i > 0) header += ", ";
    header += std::to_string(tensor.shape[i]);
  }
  if (tensor.shape.size() == 1) header += ",";
  header += "), }";
  // Like np.save: room for the first dimension to grow to 21 digits, so the bytes match NumPy's.
  if (!tensor.shape.empty()) header.append(21 - std::min<size_t>(21, std::to_string(tensor.shape[0]).size()), ' ');
  // Version 1.0 unless the padded header needs more than its 2-byte length field can hold.
  const size_t base_prefix = kMagicLen + 2;
  const auto padded_header_size = [&](size_t length_bytes) {
    const size_t total = base_prefix + length_bytes + header.size() + 1;
    return header.size() + 1 + (64 - total % 64) % 64;
  };
  int major = 1;
  size_t length_bytes = 2;
  if (padded_header_size(2) > 65535) {
    major = 2;
    length_bytes = 4;
  }
  const size_t total = base_prefix + length_bytes + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::vector<uint8_t> out(kMagic, kMagic + kMagicLen);
  out.push_back(static_cast<uint8_t>(major));
  out.push_back(0);
  const uint64_t header_len = header.size();
  for (size_t i = 0; i < length_bytes; ++i) out.push_back(static_cast<uint8_t>(header_len >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), tensor.bytes.begin(), tensor.bytes.end());
  return out;
}

void write_npy(const std::filesystem::path& path, const HostTensor& tensor) {
  write_file_atomically(path, serialize_npy(tensor));
}

}  // namespace detlogp::io
