// .npy: byte-identical output to np.save, round trips, the bf16 convention, and malformed files.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "io/npy.hpp"
#include "io_test_util.hpp"

namespace {

using detlogp::io::ElementType;
using detlogp::io::HostTensor;
using detlogp::io::testing::bytes_of;
using detlogp::io::testing::expect_error;
using detlogp::io::testing::make_tensor;

// An npy file from its version, header text (written as given, no padding added) and data.
std::vector<uint8_t> raw_npy(int major, const std::string& header, const std::vector<uint8_t>& data,
                             int64_t header_len_override = -1) {
  std::vector<uint8_t> out = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<uint8_t>(major), 0};
  const uint64_t len = header_len_override < 0 ? header.size() : static_cast<uint64_t>(header_len_override);
  const int length_bytes = major == 1 ? 2 : 4;
  for (int i = 0; i < length_bytes; ++i) out.push_back(static_cast<uint8_t>(len >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// np.save's header: the dict, padded with spaces so that the data starts at a multiple of 64.
std::string numpy_header(const std::string& dict, size_t padded_len) {
  std::string h = dict;
  h.append(padded_len - 1 - dict.size(), ' ');
  return h + "\n";
}

HostTensor parse(const std::vector<uint8_t>& bytes) { return detlogp::io::parse_npy(bytes, "test.npy"); }

// Expected bytes taken from NumPy 2.4 np.save of the same arrays.
TEST(Npy, WriterMatchesNumpyByteForByte) {
  const std::vector<float> values = {0, 1, 2, 3, 4, 5};
  const HostTensor matrix = make_tensor(ElementType::f32, {2, 3}, bytes_of(values));
  const std::vector<uint8_t> expected_matrix =
      raw_npy(1, numpy_header("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 118), bytes_of(values));
  EXPECT_EQ(detlogp::io::serialize_npy(matrix), expected_matrix);
  EXPECT_EQ(expected_matrix.size(), 152u);

  const std::vector<int64_t> targets = {7, -1};
  EXPECT_EQ(
      detlogp::io::serialize_npy(make_tensor(ElementType::i64, {2}, bytes_of(targets))),
      raw_npy(1, numpy_header("{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }", 118), bytes_of(targets)));

  const std::vector<int32_t> scalar = {3};
  EXPECT_EQ(detlogp::io::serialize_npy(make_tensor(ElementType::i32, {}, bytes_of(scalar))),
            raw_npy(1, numpy_header("{'descr': '<i4', 'fortran_order': False, 'shape': (), }", 118), bytes_of(scalar)));

  EXPECT_EQ(detlogp::io::serialize_npy(make_tensor(ElementType::f32, {0, 4}, {})),
            raw_npy(1, numpy_header("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 4), }", 118), {}));
}

TEST(Npy, RoundTripEveryType) {
  const std::vector<HostTensor> tensors = {
      make_tensor(ElementType::bf16, {2, 2}, bytes_of(std::vector<uint16_t>{0x3f80, 0xbf80, 0x7fc1, 0x0001})),
      make_tensor(ElementType::f32, {3}, bytes_of(std::vector<float>{-0.0f, 1e-40f, 3.5f})),
      make_tensor(ElementType::i32, {1, 1, 2}, bytes_of(std::vector<int32_t>{-100, 5})),
      make_tensor(ElementType::i64, {2}, bytes_of(std::vector<int64_t>{INT64_MIN, INT64_MAX})),
      make_tensor(ElementType::u8, {4}, {0, 1, 254, 255}),
      make_tensor(ElementType::f32, {}, bytes_of(std::vector<float>{0.7f})),
  };
  for (const HostTensor& t : tensors) {
    const std::vector<uint8_t> bytes = detlogp::io::serialize_npy(t);
    const size_t header_end = 10 + (bytes[8] | (bytes[9] << 8));
    EXPECT_EQ(header_end % 64, 0u) << "data must start 64-byte aligned";
    const HostTensor back = parse(bytes);
    EXPECT_EQ(back.dtype, t.dtype);
    EXPECT_EQ(back.shape, t.shape);
    EXPECT_EQ(back.bytes, t.bytes);
  }
}

TEST(Npy, Bf16IsWrittenAsU2AndReadFromAnyTwoByteIntegerOrVoid) {
  const std::vector<uint8_t> bytes =
      detlogp::io::serialize_npy(make_tensor(ElementType::bf16, {1}, bytes_of(std::vector<uint16_t>{0x3f80})));
  const std::string text(bytes.begin(), bytes.end());
  EXPECT_NE(text.find("'descr': '<u2'"), std::string::npos);
  for (const char* descr : {"<u2", "<i2", "|V2", "<V2", "V2"}) {
    const HostTensor t = parse(
        raw_npy(1, std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (1,), }\n", {0x80, 0x3f}));
    EXPECT_EQ(t.dtype, ElementType::bf16) << descr;
  }
}

TEST(Npy, AcceptsVersions2And3DoubleQuotesAndPython2Longs) {
  const std::vector<float> data = {1, 2, 3, 4, 5, 6};
  HostTensor t =
      parse(raw_npy(2, "{\"shape\": (2L, 3L), \"fortran_order\": False, \"descr\": \"<f4\"}\n", bytes_of(data)));
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 3}));
  t = parse(raw_npy(3, "{'descr':'<f4','fortran_order':False,'shape':(6,)}  \n", bytes_of(data)));
  EXPECT_EQ(t.shape, (std::vector<int64_t>{6}));
}

TEST(Npy, LargeHeaderUsesVersion2) {
  // 30,000 dimensions of 1: the dict needs more than the 65535 bytes version 1.0 can describe.
  HostTensor t = make_tensor(ElementType::u8, std::vector<int64_t>(30000, 1), {42});
  const std::vector<uint8_t> bytes = detlogp::io::serialize_npy(t);
  EXPECT_EQ(bytes[6], 2);
  const HostTensor back = parse(bytes);
  EXPECT_EQ(back.shape.size(), 30000u);
  EXPECT_EQ(back.bytes, t.bytes);
}

const std::vector<uint8_t> kFourFloats(16, 0);

TEST(NpyMalformed, MagicAndVersion) {
  expect_error([] { parse({}); }, {"test.npy", "not an .npy file"});
  expect_error([] { parse({'P', 'K', 3, 4, 0, 0, 0, 0}); }, {"test.npy", "not an .npy file"});
  expect_error([] { parse(raw_npy(4, "{}\n", {})); }, {"test.npy", "version 4.0 is not supported"});
  std::vector<uint8_t> only_magic = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, 5};
  expect_error([&] { parse(only_magic); }, {"file too short"});
}

TEST(NpyMalformed, HeaderLength) {
  expect_error([] { parse(raw_npy(1, "{}\n", {}, 500)); }, {"header length 500", "larger than the rest of the file"});
  expect_error([] { parse(raw_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", kFourFloats)); },
               {"must end with a newline"});
}

TEST(NpyMalformed, HeaderDict) {
  expect_error([] { parse(raw_npy(1, "{'descr': '<f4', 'shape': (4,), }\n", kFourFloats)); },
               {"lacks the key 'fortran_order'"});
  expect_error(
      [] { parse(raw_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4,), 'x': 1}\n", kFourFloats)); },
      {"unknown key 'x'"});
  expect_error(
      [] {
        parse(raw_npy(1, "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (4,)}\n", kFourFloats));
      },
      {"duplicate key 'descr'"});
  expect_error([] { parse(raw_npy(1, "{'descr': '<f4', 'fortran_order': 0, 'shape': (4,)}\n", kFourFloats)); },
               {"True or False"});
  expect_error([] { parse(raw_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4)}\n", kFourFloats)); },
               {"trailing comma"});
  expect_error([] { parse(raw_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (-4,)}\n", kFourFloats)); },
               {"non-negative integers"});
  expect_error([] { parse(raw_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4,)} junk\n", kFourFloats)); },
               {"unexpected characters after the header dict"});
  expect_error([] { parse(raw_npy(1, "'descr'\n", kFourFloats)); }, {"expected '{'"});
}

TEST(NpyMalformed, FortranOrderRejected) {
  expect_error([] { parse(raw_npy(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }\n", kFourFloats)); },
               {"test.npy", "fortran_order is True", "C-order"});
}

TEST(NpyMalformed, UnsupportedDescr) {
  expect_error([] { parse(raw_npy(1, "{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }\n", kFourFloats)); },
               {"'>f4'", "big-endian"});
  expect_error([] { parse(raw_npy(1, "{'descr': '<c8', 'fortran_order': False, 'shape': (2,), }\n", kFourFloats)); },
               {"descr '<c8' is not supported"});
}

// Read so that the tensor's consumer can refuse the dtype by name (the CLI: `hidden must be bf16, got f16`).
TEST(Npy, HalfDoubleAndBoolAreReadWithTheirTypes) {
  const std::pair<const char*, ElementType> cases[] = {
      {"<f2", ElementType::f16}, {"<f8", ElementType::f64}, {"|b1", ElementType::boolean}};
  for (const auto& [descr, type] : cases) {
    const int64_t count = 16 / detlogp::io::element_size(type);
    const auto t = parse(raw_npy(1,
                                 std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (" +
                                     std::to_string(count) + ",), }\n",
                                 kFourFloats));
    EXPECT_EQ(t.dtype, type) << descr;
    EXPECT_EQ(t.shape, std::vector<int64_t>{count}) << descr;
  }
}

TEST(NpyMalformed, DataSizeMismatch) {
  expect_error([] { parse(raw_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }\n", kFourFloats)); },
               {"shape [5]", "needs 20 data bytes", "holds 16"});
  expect_error([] { parse(raw_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }\n", kFourFloats)); },
               {"needs 12 data bytes", "holds 16"});
  expect_error(
      [] {
        parse(
            raw_npy(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }\n", kFourFloats));
      },
      {"too many elements"});
}

TEST(NpyFiles, WriteReadAndMissingFile) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "detlogp_io_npy";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const HostTensor t = make_tensor(ElementType::i32, {2}, bytes_of(std::vector<int32_t>{1, 2}));
  detlogp::io::write_npy(dir / "t.npy", t);
  EXPECT_EQ(detlogp::io::read_npy(dir / "t.npy").bytes, t.bytes);
  expect_error([&] { detlogp::io::read_npy(dir / "absent.npy"); }, {"absent.npy': no such file"});
  expect_error([&] { detlogp::io::map_npy(dir / "absent.npy"); }, {"absent.npy': no such file"});
  expect_error([&] { detlogp::io::read_npy(dir); }, {"it is a directory"});
  // The mapped reader views the data in the file's pages.
  const detlogp::io::MappedNpy m = detlogp::io::map_npy(dir / "t.npy");
  EXPECT_EQ(std::vector<uint8_t>(m.tensor.bytes.begin(), m.tensor.bytes.end()), t.bytes);
  EXPECT_EQ(m.tensor.shape, t.shape);
  EXPECT_EQ(m.tensor.bytes.data(), m.file->bytes().data() + m.file->bytes().size() - t.bytes.size());
  std::filesystem::remove_all(dir);
}

}  // namespace
