#include "io/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <set>
#include <sstream>

#include "io/header_cursor.hpp"
#include "io/json.hpp"

namespace detlogp::io {
namespace {

// ---------------------------------------------------------------------------------------------
// A strict JSON parser for the subset a safetensors header uses: objects, arrays, strings (with
// every JSON escape, UTF-8 validated) and integers. Floats, true/false/null, duplicate keys,
// deep nesting and anything after the top-level value other than whitespace are rejected.

struct JsonValue {
  enum class Kind { object, array, string, integer };
  Kind kind = Kind::object;
  size_t offset = 0;  // byte offset in the header, for error messages
  std::string text;   // string
  int64_t integer = 0;
  std::vector<std::pair<std::string, JsonValue>> members;  // object, in document order
  std::vector<JsonValue> elements;                         // array
};

const char* kind_name(JsonValue::Kind k) {
  switch (k) {
    case JsonValue::Kind::object:
      return "an object";
    case JsonValue::Kind::array:
      return "an array";
    case JsonValue::Kind::string:
      return "a string";
    case JsonValue::Kind::integer:
      return "an integer";
  }
  return "?";
}

class JsonParser : HeaderCursor {
 public:
  JsonParser(std::string_view text, const std::string& source)
      : HeaderCursor(text, source, "header is not valid JSON") {}

  JsonValue parse_document() {
    skip_whitespace();
    JsonValue root = parse_value(0);
    expect_end("unexpected trailing characters after the JSON header object");
    return root;
  }

 private:
  static constexpr int kMaxDepth = 16;

  JsonValue value_at_pos(JsonValue::Kind kind) const {
    JsonValue v;
    v.kind = kind;
    v.offset = pos_;
    return v;
  }

  JsonValue parse_value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth) + " levels");
    if (at_end()) fail("unexpected end of header");
    const char c = peek();
    if (c == '{') return parse_object(depth);
    if (c == '[') return parse_array(depth);
    if (c == '"') {
      JsonValue v = value_at_pos(JsonValue::Kind::string);
      v.text = parse_string();
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) return parse_integer();
    if (c == 't' || c == 'f' || c == 'n') fail("true/false/null are not used by safetensors headers");
    fail(std::string("unexpected character '") + printable(c) + "'");
  }

  static std::string printable(char c) {
    if (static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) < 0x7f) return std::string(1, c);
    std::ostringstream os;
    os << "\\x" << std::hex << static_cast<int>(static_cast<unsigned char>(c));
    return os.str();
  }

  JsonValue parse_object(int depth) {
    JsonValue v = value_at_pos(JsonValue::Kind::object);
    std::set<std::string> seen;
    read_list('{', "", '}', "or ',' in object", TrailingComma::rejected, [&] {
      if (peek() != '"') fail("expected a string key in object");
      Key key = read_key([&] { return parse_string(); }, seen, '"', "after an object key");
      JsonValue member = parse_value(depth + 1);
      v.members.emplace_back(std::move(key.text), std::move(member));
    });
    return v;
  }

  JsonValue parse_array(int depth) {
    JsonValue v = value_at_pos(JsonValue::Kind::array);
    read_list('[', "", ']', "or ',' in array", TrailingComma::rejected,
              [&] { v.elements.push_back(parse_value(depth + 1)); });
    return v;
  }

  JsonValue parse_integer() {
    JsonValue v = value_at_pos(JsonValue::Kind::integer);
    bool negative = false;
    if (peek() == '-') {
      negative = true;
      ++pos_;
    }
    if (!(peek() >= '0' && peek() <= '9')) fail("expected a digit");
    if (peek() == '0' && pos_ + 1 < text_.size() && text_[pos_ + 1] >= '0' && text_[pos_ + 1] <= '9')
      fail("leading zeros are not valid JSON");
    uint64_t magnitude = 0;
    const uint64_t limit = negative ? uint64_t{1} << 63 : static_cast<uint64_t>(INT64_MAX);
    while (peek() >= '0' && peek() <= '9') {
      const uint64_t digit = static_cast<uint64_t>(peek() - '0');
      if (magnitude > (limit - digit) / 10) fail("integer does not fit in 64 bits");
      magnitude = magnitude * 10 + digit;
      ++pos_;
    }
    if (peek() == '.' || peek() == 'e' || peek() == 'E') fail("only integers are allowed (no fractions or exponents)");
    v.integer = negative ? static_cast<int64_t>(0 - magnitude) : static_cast<int64_t>(magnitude);
    return v;
  }

  unsigned parse_hex4() {
    if (pos_ + 4 > text_.size()) fail("truncated \\u escape");
    unsigned value = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[pos_++];
      value <<= 4;
      if (c >= '0' && c <= '9')
        value |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f')
        value |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        value |= static_cast<unsigned>(c - 'A' + 10);
      else
        fail("invalid hex digit in \\u escape");
    }
    return value;
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  // Copies one well-formed UTF-8 sequence starting at pos_ (rejects overlongs and surrogates).
  void copy_utf8_sequence(std::string& out) {
    const auto lead = static_cast<unsigned char>(text_[pos_]);
    int length = 0;
    uint32_t cp = 0;
    if (lead >= 0xC2 && lead <= 0xDF)
      length = 2, cp = lead & 0x1F;
    else if (lead >= 0xE0 && lead <= 0xEF)
      length = 3, cp = lead & 0x0F;
    else if (lead >= 0xF0 && lead <= 0xF4)
      length = 4, cp = lead & 0x07;
    else
      fail("invalid UTF-8 in string");
    if (pos_ + static_cast<size_t>(length) > text_.size()) fail("truncated UTF-8 sequence in string");
    for (int i = 1; i < length; ++i) {
      const auto cont = static_cast<unsigned char>(text_[pos_ + static_cast<size_t>(i)]);
      if ((cont & 0xC0) != 0x80) fail("invalid UTF-8 in string");
      cp = (cp << 6) | (cont & 0x3F);
    }
    const uint32_t min_cp = length == 2 ? 0x80 : length == 3 ? 0x800 : 0x10000;
    if (cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) fail("invalid UTF-8 in string");
    out.append(text_.substr(pos_, static_cast<size_t>(length)));
    pos_ += static_cast<size_t>(length);
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    while (true) {
      if (at_end()) fail("unterminated string");
      const char c = text_[pos_];
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail("unescaped control character in string");
      if (static_cast<unsigned char>(c) >= 0x80) {
        copy_utf8_sequence(out);
        continue;
      }
      if (c != '\\') {
        out += c;
        ++pos_;
        continue;
      }
      ++pos_;
      if (at_end()) fail("unterminated escape in string");
      const char e = text_[pos_++];
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          uint32_t cp = parse_hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail("unpaired low surrogate in \\u escape");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (pos_ + 2 > text_.size() || text_[pos_] != '\\' || text_[pos_ + 1] != 'u')
              fail("unpaired high surrogate in \\u escape");
            pos_ += 2;
            const uint32_t low = parse_hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail("unpaired high surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default:
          fail(std::string("invalid escape '\\") + printable(e) + "'");
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------

bool parse_dtype(const std::string& name, ElementType* out) {
  for (const ElementTypeInfo& info : kElementTypes) {
    if (name == info.name) {
      *out = info.type;
      return true;
    }
  }
  return false;
}

struct TensorRecord {
  std::string name;
  ElementType dtype;
  std::vector<int64_t> shape;
  uint64_t begin;
  uint64_t end;
};

TensorRecord parse_tensor_entry(const std::string& name, const JsonValue& entry, const std::string& source) {
  const std::string where = "'" + source + "': tensor '" + name + "'";
  DETLOGP_CHECK(!name.empty(), "'" << source << "': a tensor has an empty name");
  DETLOGP_CHECK(entry.kind == JsonValue::Kind::object,
                where << ": header entry must be an object, got " << kind_name(entry.kind));
  const JsonValue* dtype = nullptr;
  const JsonValue* shape = nullptr;
  const JsonValue* offsets = nullptr;
  for (const auto& [key, value] : entry.members) {
    if (key == "dtype")
      dtype = &value;
    else if (key == "shape")
      shape = &value;
    else if (key == "data_offsets")
      offsets = &value;
    else
      DETLOGP_FAIL(where << ": unknown field \"" << key << "\" (expected dtype, shape, data_offsets)");
  }
  DETLOGP_CHECK(dtype != nullptr, where << ": missing field \"dtype\"");
  DETLOGP_CHECK(shape != nullptr, where << ": missing field \"shape\"");
  DETLOGP_CHECK(offsets != nullptr, where << ": missing field \"data_offsets\"");

  TensorRecord r;
  r.name = name;
  DETLOGP_CHECK(dtype->kind == JsonValue::Kind::string, where << ": \"dtype\" must be a string");
  DETLOGP_CHECK(parse_dtype(dtype->text, &r.dtype),
                where << ": dtype \"" << dtype->text
                      << "\" is not supported (supported: BF16, F32, I32, I64, U8, F16, F64, BOOL)");

  DETLOGP_CHECK(shape->kind == JsonValue::Kind::array, where << ": \"shape\" must be an array of integers");
  for (const JsonValue& d : shape->elements) {
    DETLOGP_CHECK(d.kind == JsonValue::Kind::integer, where << ": \"shape\" must contain only integers");
    DETLOGP_CHECK(d.integer >= 0, where << ": \"shape\" has a negative dimension " << d.integer);
    r.shape.push_back(d.integer);
  }
  const int64_t count = checked_element_count(r.shape);
  DETLOGP_CHECK(count >= 0, where << ": shape " << shape_to_string(r.shape) << " has too many elements");

  DETLOGP_CHECK(offsets->kind == JsonValue::Kind::array && offsets->elements.size() == 2,
                where << ": \"data_offsets\" must be an array [begin, end]");
  for (const JsonValue& o : offsets->elements) {
    DETLOGP_CHECK(o.kind == JsonValue::Kind::integer && o.integer >= 0,
                  where << ": \"data_offsets\" must hold two non-negative integers");
  }
  r.begin = static_cast<uint64_t>(offsets->elements[0].integer);
  r.end = static_cast<uint64_t>(offsets->elements[1].integer);
  DETLOGP_CHECK(r.begin <= r.end, where << ": data_offsets [" << r.begin << ", " << r.end << "] has begin > end");
  const int size = element_size(r.dtype);
  DETLOGP_CHECK(static_cast<uint64_t>(count) <= UINT64_MAX / static_cast<uint64_t>(size),
                where << ": shape " << shape_to_string(r.shape) << " has too many elements");
  const uint64_t expected = static_cast<uint64_t>(count) * static_cast<uint64_t>(size);
  DETLOGP_CHECK(r.end - r.begin == expected, where << ": shape " << shape_to_string(r.shape) << " x "
                                                   << element_type_name(r.dtype) << " (" << size << " bytes) needs "
                                                   << expected << " bytes but data_offsets [" << r.begin << ", "
                                                   << r.end << "] span " << (r.end - r.begin));
  return r;
}

void parse_metadata(const JsonValue& value, const std::string& source, std::map<std::string, std::string>* out) {
  DETLOGP_CHECK(value.kind == JsonValue::Kind::object,
                "'" << source << "': \"__metadata__\" must be an object of strings, got " << kind_name(value.kind));
  for (const auto& [key, v] : value.members) {
    DETLOGP_CHECK(v.kind == JsonValue::Kind::string, "'" << source << "': \"__metadata__\" value of \"" << key
                                                         << "\" must be a string, got " << kind_name(v.kind));
    (*out)[key] = v.text;
  }
}

void check_tensor_for_write(const NamedTensor& t) {
  DETLOGP_CHECK(!t.name.empty(), "safetensors writer: a tensor has an empty name");
  DETLOGP_CHECK(t.name != "__metadata__", "safetensors writer: \"__metadata__\" is reserved, not a tensor name");
  const int64_t count = t.tensor.element_count();
  DETLOGP_CHECK(count >= 0, "safetensors writer: tensor '" << t.name << "' has an invalid shape "
                                                           << shape_to_string(t.tensor.shape));
  DETLOGP_CHECK(t.tensor.bytes.size() == static_cast<size_t>(count) * static_cast<size_t>(element_size(t.tensor.dtype)),
                "safetensors writer: tensor '" << t.name << "' holds " << t.tensor.bytes.size() << " bytes, its shape "
                                               << shape_to_string(t.tensor.shape) << " x "
                                               << element_type_name(t.tensor.dtype) << " needs "
                                               << count * element_size(t.tensor.dtype));
}

}  // namespace

const HostTensor* SafetensorsContents::find(std::string_view name) const {
  for (const NamedTensor& t : tensors)
    if (t.name == name) return &t.tensor;
  return nullptr;
}

void SafetensorsContents::add(std::string name, HostTensor tensor) {
  DETLOGP_CHECK(find(name) == nullptr, "safetensors: duplicate tensor name '" << name << "'");
  tensors.push_back({std::move(name), std::move(tensor)});
}

const TensorRef* SafetensorsRefs::find(std::string_view name) const {
  for (const NamedTensorRef& t : tensors)
    if (t.name == name) return &t.tensor;
  return nullptr;
}

SafetensorsRefs index_safetensors(std::span<const uint8_t> file_bytes, const std::string& source) {
  const uint64_t file_size = file_bytes.size();
  DETLOGP_CHECK(file_size >= 8, "'" << source << "': file too short (" << file_size
                                    << " bytes); a safetensors file starts with an 8-byte header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | file_bytes[static_cast<size_t>(i)];
  DETLOGP_CHECK(header_len >= 2,
                "'" << source << "': header length " << header_len << " is too small for a JSON object");
  DETLOGP_CHECK(header_len <= kMaxSafetensorsHeaderBytes, "'" << source << "': header length " << header_len
                                                              << " is absurd (limit " << kMaxSafetensorsHeaderBytes
                                                              << " bytes); not a safetensors file?");
  DETLOGP_CHECK(header_len <= file_size - 8, "'" << source << "': header length " << header_len
                                                 << " is larger than the rest of the file (" << file_size - 8
                                                 << " bytes); truncated file?");
  const std::string_view header(reinterpret_cast<const char*>(file_bytes.data() + 8), header_len);
  DETLOGP_CHECK(header.front() == '{', "'" << source << "': header does not start with '{'");

  const JsonValue root = JsonParser(header, source).parse_document();
  DETLOGP_CHECK(root.kind == JsonValue::Kind::object, "'" << source << "': header must be a JSON object");

  SafetensorsRefs contents;
  std::vector<TensorRecord> records;
  for (const auto& [key, value] : root.members) {
    if (key == "__metadata__")
      parse_metadata(value, source, &contents.metadata);
    else
      records.push_back(parse_tensor_entry(key, value, source));
  }

  // The data region must be indexed exactly: in bounds, no overlaps, no holes, nothing after.
  const uint64_t data_size = file_size - 8 - header_len;
  std::stable_sort(records.begin(), records.end(), [](const TensorRecord& a, const TensorRecord& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const TensorRecord* previous = nullptr;
  for (const TensorRecord& r : records) {
    DETLOGP_CHECK(r.end <= data_size, "'" << source << "': tensor '" << r.name << "': data_offsets [" << r.begin << ", "
                                          << r.end << "] out of bounds: the data region holds " << data_size
                                          << " bytes");
    DETLOGP_CHECK(r.begin >= covered, "'" << source << "': tensors '" << previous->name << "' [" << previous->begin
                                          << ", " << previous->end << ") and '" << r.name << "' [" << r.begin << ", "
                                          << r.end << ") overlap");
    DETLOGP_CHECK(r.begin == covered, "'" << source << "': data bytes [" << covered << ", " << r.begin
                                          << ") belong to no tensor (the data region must be indexed contiguously)");
    covered = r.end;
    previous = &r;
  }
  DETLOGP_CHECK(covered == data_size, "'" << source << "': " << data_size - covered
                                          << " trailing data bytes after byte " << covered << " belong to no tensor");

  const std::span<const uint8_t> data = file_bytes.subspan(8 + header_len);
  for (TensorRecord& r : records) {
    TensorRef t;
    t.dtype = r.dtype;
    t.shape = std::move(r.shape);
    t.bytes = data.subspan(r.begin, r.end - r.begin);
    contents.tensors.push_back({std::move(r.name), std::move(t)});
  }
  return contents;
}

SafetensorsContents parse_safetensors(std::span<const uint8_t> file_bytes, const std::string& source) {
  SafetensorsRefs refs = index_safetensors(file_bytes, source);
  SafetensorsContents contents;
  contents.metadata = std::move(refs.metadata);
  for (const NamedTensorRef& t : refs.tensors) contents.tensors.push_back({t.name, t.tensor.copy()});
  return contents;
}

MappedSafetensors map_safetensors(const std::filesystem::path& path) {
  MappedSafetensors m;
  m.file = std::make_shared<const MappedFile>(path);
  m.contents = index_safetensors(m.file->bytes(), path.string());
  return m;
}

SafetensorsContents read_safetensors(const std::filesystem::path& path) {
  const MappedFile file(path);
  return parse_safetensors(file.bytes(), path.string());
}

std::vector<uint8_t> serialize_safetensors(const SafetensorsContents& contents) {
  std::vector<const NamedTensor*> order;
  std::set<std::string> names;
  for (const NamedTensor& t : contents.tensors) {
    check_tensor_for_write(t);
    DETLOGP_CHECK(names.insert(t.name).second, "safetensors writer: duplicate tensor name '" << t.name << "'");
    order.push_back(&t);
  }
  std::sort(order.begin(), order.end(), [](const NamedTensor* a, const NamedTensor* b) {
    const int sa = element_size(a->tensor.dtype), sb = element_size(b->tensor.dtype);
    return sa != sb ? sa > sb : a->name < b->name;
  });

  std::string header = "{";
  bool first = true;
  if (!contents.metadata.empty()) {
    header += "\"__metadata__\":{";
    for (auto it = contents.metadata.begin(); it != contents.metadata.end(); ++it) {
      if (it != contents.metadata.begin()) header += ",";
      header += json_quote(it->first) + ":" + json_quote(it->second);
    }
    header += "}";
    first = false;
  }
  uint64_t offset = 0;
  for (const NamedTensor* t : order) {
    if (!first) header += ",";
    first = false;
    const uint64_t end = offset + t->tensor.bytes.size();
    header += json_quote(t->name) + ":{\"dtype\":\"" + element_type_name(t->tensor.dtype) + "\",\"shape\":[";
    for (size_t i = 0; i < t->tensor.shape.size(); ++i) {
      if (i > 0) header += ",";
      header += std::to_string(t->tensor.shape[i]);
    }
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(end) + "]}";
    offset = end;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // data starts 8-byte aligned

  std::vector<uint8_t> out;
  out.reserve(8 + header.size() + offset);
  const uint64_t header_len = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(header_len >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  for (const NamedTensor* t : order) out.insert(out.end(), t->tensor.bytes.begin(), t->tensor.bytes.end());
  return out;
}

void write_safetensors(const std::filesystem::path& path, const SafetensorsContents& contents) {
  write_file_atomically(path, serialize_safetensors(contents));
}

}  // namespace detlogp::io
