// safetensors: round trip, canonical output, and one test per malformed-file class, each checking
// that the error names the file and the offending field.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "io/safetensors.hpp"
#include "io_test_util.hpp"

namespace {

using detlogp::io::ElementType;
using detlogp::io::HostTensor;
using detlogp::io::SafetensorsContents;
using detlogp::io::testing::bytes_of;
using detlogp::io::testing::expect_error;
using detlogp::io::testing::make_tensor;

// A file from a header text and a data region, with the header length field as given (or the
// true header length when header_len_override < 0).
std::vector<uint8_t> raw_file(const std::string& header, const std::vector<uint8_t>& data,
                              int64_t header_len_override = -1) {
  const uint64_t len = header_len_override < 0 ? header.size() : static_cast<uint64_t>(header_len_override);
  std::vector<uint8_t> out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(len >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

SafetensorsContents parse(const std::vector<uint8_t>& bytes) {
  return detlogp::io::parse_safetensors(bytes, "test.safetensors");
}

void expect_parse_error(const std::string& header, const std::vector<uint8_t>& data,
                        std::initializer_list<const char*> needles) {
  expect_error([&] { parse(raw_file(header, data)); }, needles);
}

SafetensorsContents sample_contents() {
  SafetensorsContents c;
  c.add("hidden",
        make_tensor(ElementType::bf16, {2, 3}, bytes_of(std::vector<uint16_t>{1, 2, 3, 0x7fc0, 0x8000, 65535})));
  c.add("logp", make_tensor(ElementType::f32, {3}, bytes_of(std::vector<float>{-0.0f, 1.5f, -3.25f})));
  c.add("targets", make_tensor(ElementType::i64, {2}, bytes_of(std::vector<int64_t>{-100, 31999})));
  c.add("t32", make_tensor(ElementType::i32, {1, 2}, bytes_of(std::vector<int32_t>{7, -7})));
  c.add("owned", make_tensor(ElementType::u8, {3}, {1, 0, 1}));
  c.add("temperature", make_tensor(ElementType::f32, {}, bytes_of(std::vector<float>{0.7f})));
  c.add("empty", make_tensor(ElementType::f32, {0, 5}, {}));
  c.metadata["format"] = "pt";
  c.metadata["note \"quoted\"\n"] = "caf\xc3\xa9";
  return c;
}

TEST(Safetensors, RoundTripKeepsEveryTensorAndMetadata) {
  const SafetensorsContents original = sample_contents();
  const std::vector<uint8_t> bytes = detlogp::io::serialize_safetensors(original);
  const SafetensorsContents back = parse(bytes);
  ASSERT_EQ(back.tensors.size(), original.tensors.size());
  for (const auto& t : original.tensors) {
    const HostTensor* r = back.find(t.name);
    ASSERT_NE(r, nullptr) << t.name;
    EXPECT_EQ(r->dtype, t.tensor.dtype) << t.name;
    EXPECT_EQ(r->shape, t.tensor.shape) << t.name;
    EXPECT_EQ(r->bytes, t.tensor.bytes) << t.name;
  }
  EXPECT_EQ(back.metadata, original.metadata);
}

TEST(Safetensors, OutputIsCanonicalAndAligned) {
  const SafetensorsContents a = sample_contents();
  SafetensorsContents b;  // same tensors, added in reverse order
  for (auto it = a.tensors.rbegin(); it != a.tensors.rend(); ++it) b.add(it->name, it->tensor);
  b.metadata = a.metadata;
  const std::vector<uint8_t> bytes_a = detlogp::io::serialize_safetensors(a);
  EXPECT_EQ(bytes_a, detlogp::io::serialize_safetensors(b));

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes_a[static_cast<size_t>(i)];
  EXPECT_EQ(header_len % 8, 0u);
  const std::string header(bytes_a.begin() + 8, bytes_a.begin() + 8 + static_cast<std::ptrdiff_t>(header_len));
  EXPECT_EQ(header.rfind("{\"__metadata__\":{", 0), 0u) << header;
  // Largest elements first, so each tensor's data is aligned to its element size.
  EXPECT_LT(header.find("\"targets\""), header.find("\"logp\""));
  EXPECT_LT(header.find("\"logp\""), header.find("\"hidden\""));
  EXPECT_LT(header.find("\"hidden\""), header.find("\"owned\""));
  EXPECT_NO_THROW(parse(bytes_a));
}

TEST(Safetensors, ExactBytesOfASmallFile) {
  SafetensorsContents c;
  c.add("x", make_tensor(ElementType::f32, {1}, bytes_of(std::vector<float>{1.0f})));
  const std::vector<uint8_t> bytes = detlogp::io::serialize_safetensors(c);
  const std::string header = "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}  ";
  EXPECT_EQ(bytes, raw_file(header, bytes_of(std::vector<float>{1.0f})));
}

TEST(Safetensors, AcceptsWhitespaceEscapesAndAnyKeyOrder) {
  const std::string header =
      "{\n \"__metadata__\" : { \"k\\u00e9\\ud83d\\ude00\" : \"v\\\\\\/\\\"\" } ,\n"
      "  \"b\\tname\" : { \"data_offsets\" : [ 4 , 8 ], \"shape\" : [ 1 ], \"dtype\" : \"I32\" },\n"
      "  \"a\" : { \"dtype\" : \"BF16\", \"shape\" : [ 2 ], \"data_offsets\" : [0, 4] } }   ";
  const SafetensorsContents c = parse(raw_file(header, {1, 0, 2, 0, 9, 0, 0, 0}));
  ASSERT_EQ(c.tensors.size(), 2u);
  EXPECT_EQ(c.tensors[0].name, "a");  // data order
  EXPECT_EQ(c.tensors[1].name, "b\tname");
  EXPECT_EQ(c.tensors[1].tensor.dtype, ElementType::i32);
  EXPECT_EQ(c.metadata.at("k\xc3\xa9\xf0\x9f\x98\x80"), "v\\/\"");
}

TEST(Safetensors, ZeroSizedAndScalarTensors) {
  const std::string header =
      "{\"e\":{\"dtype\":\"F32\",\"shape\":[0,3],\"data_offsets\":[0,0]},"
      "\"s\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[0,8]}}";
  const SafetensorsContents c = parse(raw_file(header, bytes_of(std::vector<int64_t>{42})));
  EXPECT_EQ(c.find("e")->bytes.size(), 0u);
  EXPECT_EQ(c.find("s")->shape.size(), 0u);
  EXPECT_EQ(c.find("s")->element_count(), 1);
}

TEST(SafetensorsMalformed, TooShort) {
  expect_error([] { parse({}); }, {"test.safetensors", "file too short"});
  expect_error([] { parse({1, 0, 0, 0, 0, 0, 0}); }, {"test.safetensors", "file too short"});
}

TEST(SafetensorsMalformed, HeaderLengthBeyondFile) {
  const std::string header = "{}";
  expect_error([&] { parse(raw_file(header, {}, 1000)); }, {"header length 1000", "larger than the rest of the file"});
}

TEST(SafetensorsMalformed, HeaderLengthAbsurd) {
  expect_error([] { parse(raw_file("{}", {}, int64_t{1} << 40)); }, {"header length 1099511627776", "absurd"});
  expect_error([] { parse(raw_file("{}", {}, 0)); }, {"header length 0", "too small"});
}

TEST(SafetensorsMalformed, TruncatedFile) {
  std::vector<uint8_t> bytes = detlogp::io::serialize_safetensors(sample_contents());
  bytes.resize(bytes.size() - 3);
  expect_error([&] { parse(bytes); }, {"test.safetensors", "out of bounds"});
  bytes.resize(20);
  expect_error([&] { parse(bytes); }, {"larger than the rest of the file"});
}

TEST(SafetensorsMalformed, HeaderNotAnObject) {
  expect_parse_error("[1, 2]", {}, {"does not start with '{'"});
  expect_parse_error("xx", {}, {"does not start with '{'"});
  expect_parse_error(" {}", {}, {"does not start with '{'"});  // the spec: the header MUST begin with '{'
}

TEST(SafetensorsMalformed, BadJson) {
  const std::vector<uint8_t> none;
  expect_parse_error("{\"a\":{}", none, {"not valid JSON", "expected '}' or ','"});
  expect_parse_error("{} trailing", none, {"not valid JSON", "trailing"});
  expect_parse_error("{}{}", none, {"not valid JSON", "trailing"});
  expect_parse_error("{\"a\" 1}", none, {"not valid JSON", "expected ':'"});
  expect_parse_error("{\"a\":1,}", none, {"not valid JSON", "expected a string key"});
  expect_parse_error("{'a':1}", none, {"not valid JSON", "expected a string key"});
  expect_parse_error("{\"a\":[1,2}", none, {"not valid JSON", "expected ']' or ','"});
  expect_parse_error("{\"a\":\"unterminated}", none, {"not valid JSON", "unterminated string"});
  expect_parse_error("{\"a\":\"bad \\q escape\"}", none, {"not valid JSON", "invalid escape"});
  expect_parse_error("{\"a\":\"tab\there\"}", none, {"not valid JSON", "control character"});
  expect_parse_error("{\"a\":\"\\ud800\"}", none, {"not valid JSON", "surrogate"});
  expect_parse_error("{\"a\":\"\\udc00\"}", none, {"not valid JSON", "surrogate"});
  expect_parse_error("{\"a\":\"\\u12G4\"}", none, {"not valid JSON", "hex digit"});
  expect_parse_error("{\"a\":\"\xff\"}", none, {"not valid JSON", "UTF-8"});
  expect_parse_error("{\"a\":\"\xc0\xaf\"}", none, {"not valid JSON", "UTF-8"});  // overlong '/'
  expect_parse_error("{\"a\":1.5}", none, {"not valid JSON", "only integers"});
  expect_parse_error("{\"a\":1e3}", none, {"not valid JSON", "only integers"});
  expect_parse_error("{\"a\":012}", none, {"not valid JSON", "leading zeros"});
  expect_parse_error("{\"a\":-}", none, {"not valid JSON", "expected a digit"});
  expect_parse_error("{\"a\":99999999999999999999}", none, {"not valid JSON", "64 bits"});
  expect_parse_error("{\"a\":true}", none, {"not valid JSON", "true/false/null"});
  expect_parse_error("{\"a\":null}", none, {"not valid JSON", "true/false/null"});
  expect_parse_error("{\"a\":1, \"a\":2}", none, {"not valid JSON", "duplicate key \"a\""});
  expect_parse_error("{\"a\":" + std::string(40, '[') + std::string(40, ']') + "}", none,
                     {"not valid JSON", "nesting deeper"});
  std::string with_nul = "{}";
  with_nul += '\0';
  expect_parse_error(with_nul, none, {"not valid JSON", "trailing"});
}

TEST(SafetensorsMalformed, UnsupportedDtypeNamesTensorAndDtype) {
  expect_parse_error("{\"weight\":{\"dtype\":\"U16\",\"shape\":[1],\"data_offsets\":[0,2]}}", {0, 0},
                     {"tensor 'weight'", "dtype \"U16\" is not supported"});
  expect_parse_error("{\"weight\":{\"dtype\":\"bf16\",\"shape\":[1],\"data_offsets\":[0,2]}}", {0, 0},
                     {"tensor 'weight'", "dtype \"bf16\""});
  expect_parse_error("{\"w\":{\"dtype\":5,\"shape\":[1],\"data_offsets\":[0,2]}}", {0, 0},
                     {"tensor 'w'", "\"dtype\" must be a string"});
}

TEST(SafetensorsMalformed, ShapeTimesDtypeSizeMismatch) {
  expect_parse_error("{\"x\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,12]}}", std::vector<uint8_t>(12),
                     {"tensor 'x'", "shape [2, 3] x F32", "needs 24 bytes", "span 12"});
  expect_parse_error("{\"x\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", std::vector<uint8_t>(4),
                     {"tensor 'x'", "negative dimension"});
  expect_parse_error("{\"x\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}",
                     std::vector<uint8_t>(4), {"tensor 'x'", "too many elements"});
  expect_parse_error("{\"x\":{\"dtype\":\"F32\",\"shape\":\"2\",\"data_offsets\":[0,4]}}", std::vector<uint8_t>(4),
                     {"tensor 'x'", "\"shape\" must be an array"});
}

TEST(SafetensorsMalformed, EntryFields) {
  expect_parse_error("{\"x\":{\"dtype\":\"F32\",\"shape\":[1]}}", std::vector<uint8_t>(4),
                     {"tensor 'x'", "missing field \"data_offsets\""});
  expect_parse_error("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"extra\":1}}",
                     std::vector<uint8_t>(4), {"tensor 'x'", "unknown field \"extra\""});
  expect_parse_error("{\"x\":[1]}", {}, {"tensor 'x'", "must be an object"});
  expect_parse_error("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", std::vector<uint8_t>(4),
                     {"tensor 'x'", "[begin, end]"});
  expect_parse_error("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}", std::vector<uint8_t>(8),
                     {"tensor 'x'", "begin > end"});
  expect_parse_error("{\"\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", std::vector<uint8_t>(4),
                     {"empty name"});
}

TEST(SafetensorsMalformed, OffsetsOutOfBounds) {
  expect_parse_error("{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", std::vector<uint8_t>(8),
                     {"tensor 'x'", "[4, 12]", "out of bounds", "holds 8 bytes"});
}

TEST(SafetensorsMalformed, OverlappingOffsets) {
  expect_parse_error(
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
      std::vector<uint8_t>(12), {"'a' [0, 8)", "'b' [4, 12)", "overlap"});
  // Two tensors sharing the same bytes (aliasing) is an overlap too.
  expect_parse_error(
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
      "\"b\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
      std::vector<uint8_t>(4), {"overlap"});
}

TEST(SafetensorsMalformed, HolesAndTrailingBytes) {
  expect_parse_error(
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
      std::vector<uint8_t>(12), {"data bytes [4, 8) belong to no tensor"});
  expect_parse_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", std::vector<uint8_t>(6),
                     {"2 trailing data bytes"});
  expect_parse_error("{}", std::vector<uint8_t>(3), {"3 trailing data bytes"});
}

TEST(SafetensorsMalformed, Metadata) {
  expect_parse_error("{\"__metadata__\":{\"k\":1}}", {}, {"\"__metadata__\" value of \"k\" must be a string"});
  expect_parse_error("{\"__metadata__\":[\"k\"]}", {}, {"\"__metadata__\" must be an object"});
}

TEST(SafetensorsFiles, MissingFileIsNamed) {
  expect_error([] { detlogp::io::read_safetensors("no/such/dir/input.safetensors"); },
               {"cannot read 'no/such/dir/input.safetensors': no such file"});
  expect_error([] { detlogp::io::map_safetensors("no/such/dir/input.safetensors"); }, {"no such file"});
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "detlogp_io_safetensors_dir";
  std::filesystem::create_directories(dir);
  expect_error([&] { detlogp::io::read_safetensors(dir); }, {"detlogp_io_safetensors_dir': it is a directory"});
  std::filesystem::remove_all(dir);
}

// The mapped reader hands out views into the file's pages: nothing is copied, the bytes are the
// written ones, and they stay valid while the mapping is held.
TEST(SafetensorsFiles, MappedTensorsViewTheFile) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "detlogp_io_safetensors_map";
  std::filesystem::remove_all(dir);
  const SafetensorsContents original = sample_contents();
  detlogp::io::write_safetensors(dir / "m.safetensors", original);
  const detlogp::io::MappedSafetensors m = detlogp::io::map_safetensors(dir / "m.safetensors");
  const std::span<const uint8_t> file = m.file->bytes();
  EXPECT_EQ(file.size(), std::filesystem::file_size(dir / "m.safetensors"));
  ASSERT_EQ(m.contents.tensors.size(), original.tensors.size());
  EXPECT_EQ(m.contents.metadata, original.metadata);
  for (const auto& t : original.tensors) {
    const detlogp::io::TensorRef* r = m.contents.find(t.name);
    ASSERT_NE(r, nullptr) << t.name;
    EXPECT_EQ(r->dtype, t.tensor.dtype) << t.name;
    EXPECT_EQ(r->shape, t.tensor.shape) << t.name;
    EXPECT_EQ(std::vector<uint8_t>(r->bytes.begin(), r->bytes.end()), t.tensor.bytes) << t.name;
    EXPECT_GE(r->bytes.data(), file.data()) << t.name;
    EXPECT_LE(r->bytes.data() + r->bytes.size(), file.data() + file.size()) << t.name;
    // The canonical writer aligns each tensor's data to its element size, in the file and so in the map.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(r->bytes.data()) % detlogp::io::element_size(r->dtype), 0u) << t.name;
  }
  std::filesystem::remove_all(dir);
}

TEST(SafetensorsFiles, WriteThenReadAndFailedWriteLeavesNothing) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "detlogp_io_safetensors";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::filesystem::path file = dir / "out.safetensors";
  detlogp::io::write_safetensors(file, sample_contents());
  EXPECT_EQ(detlogp::io::read_safetensors(file).tensors.size(), sample_contents().tensors.size());
  // Only the output itself remains: the temporary file was renamed.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()), 1);

  // Missing directories are created (mkdir -p); a path through a file, or onto a directory, fails.
  detlogp::io::write_safetensors(dir / "missing" / "deeper" / "out.safetensors", sample_contents());
  EXPECT_EQ(detlogp::io::read_safetensors(dir / "missing" / "deeper" / "out.safetensors").tensors.size(),
            sample_contents().tensors.size());
  std::filesystem::remove_all(dir / "missing");
  expect_error([&] { detlogp::io::write_safetensors(dir / "out.safetensors" / "x.safetensors", sample_contents()); },
               {"out.safetensors' is not a directory"});
  std::filesystem::create_directories(dir / "sub.safetensors");
  expect_error([&] { detlogp::io::write_safetensors(dir / "sub.safetensors", sample_contents()); },
               {"sub.safetensors': it is a directory"});
  std::filesystem::remove_all(dir / "sub.safetensors");
  SafetensorsContents bad;
  bad.add("x", make_tensor(ElementType::f32, {3}, std::vector<uint8_t>(8)));
  expect_error([&] { detlogp::io::write_safetensors(dir / "bad.safetensors", bad); },
               {"tensor 'x' holds 8 bytes", "needs 12"});
  EXPECT_FALSE(std::filesystem::exists(dir / "bad.safetensors"));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()), 1);
  std::filesystem::remove_all(dir);
}

TEST(SafetensorsFiles, WriterRejectsDuplicateAndReservedNames) {
  SafetensorsContents c;
  c.add("x", make_tensor(ElementType::u8, {1}, {1}));
  expect_error([&] { c.add("x", make_tensor(ElementType::u8, {1}, {1})); }, {"duplicate tensor name 'x'"});
  c.add("__metadata__", make_tensor(ElementType::u8, {1}, {1}));
  expect_error([&] { detlogp::io::serialize_safetensors(c); }, {"reserved"});
}

}  // namespace
