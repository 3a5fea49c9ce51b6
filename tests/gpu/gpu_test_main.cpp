// The GPU tests' shared main: gtest's flags, then the tests' own options (gpu_test_util.hpp), and
// one line naming the device the tests run on or why they are skipped.
#include <cstdio>
#include <cstring>

#include "gpu_test_util.hpp"

namespace {

class DeviceBanner : public ::testing::Environment {
 public:
  void SetUp() override { std::printf("SM90 device: %s\n", gput::sm90_device_description().c_str()); }
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--small") == 0) {
      gput::options().small = true;
    } else if (std::strcmp(argv[i], "--no-nccl") == 0) {
      gput::options().nccl = false;
    } else {
      std::fprintf(stderr, "unknown option %s (the GPU tests take gtest's flags, --small and --no-nccl)\n", argv[i]);
      return 2;
    }
  }
  ::testing::AddGlobalTestEnvironment(new DeviceBanner);
  return RUN_ALL_TESTS();
}
