// In-process ranks: threads of one process, each with its own Communicator, gathering host
// memory (the CPU backend's tensor parallelism) or CUDA memory of one device (a one-GPU
// simulation of ranks). The gather is a plain copy in rank order, like NCCL's.
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "core/device_ops.hpp"
#include "detlogp/dist.hpp"

namespace detlogp {
namespace {

// Shared by the ranks of one group: the posted send buffers and a reusable barrier.
struct LocalGroup {
  explicit LocalGroup(int ranks) : size(ranks), sends(static_cast<size_t>(ranks), nullptr) {}
  void barrier() {
    std::unique_lock<std::mutex> lock(mutex);
    const uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
    } else {
      cv.wait(lock, [&] { return generation != gen; });
    }
  }
  const int size;
  std::vector<const void*> sends;
  std::mutex mutex;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
};

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<LocalGroup> group, int rank, Memory memory, int device)
      : group_(std::move(group)), rank_(rank), memory_(memory), device_(device) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size; }
  Memory memory() const override { return memory_; }
  int device() const override { return device_; }
  const char* name() const override { return memory_ == Memory::host ? "in-process host" : "in-process CUDA"; }

  void all_gather(const void* send, void* recv, size_t bytes, void* stream) override {
    if (memory_ == Memory::cuda) detail::device_stream_sync(device_, stream);  // send bytes are final
    group_->sends[static_cast<size_t>(rank_)] = send;
    group_->barrier();
    for (int r = 0; r < group_->size; ++r) {
      void* dst = static_cast<uint8_t*>(recv) + static_cast<size_t>(r) * bytes;
      const void* src = group_->sends[static_cast<size_t>(r)];
      if (dst == src) continue;  // in place
      if (memory_ == Memory::host)
        std::memcpy(dst, src, bytes);
      else
        detail::device_copy_async(dst, src, bytes, device_, stream);
    }
    if (memory_ == Memory::cuda) detail::device_stream_sync(device_, stream);
    group_->barrier();  // nobody reuses a send buffer before every rank has read it
  }

 private:
  std::shared_ptr<LocalGroup> group_;
  int rank_;
  Memory memory_;
  int device_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_local_communicators(int ranks, Memory memory, int device) {
  DETLOGP_CHECK(ranks >= 1 && ranks <= kMaxTensorParallelRanks,
                "ranks=" << ranks << " is outside [1, " << kMaxTensorParallelRanks << "]");
  auto group = std::make_shared<LocalGroup>(ranks);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < ranks; ++r) comms.push_back(std::make_unique<LocalCommunicator>(group, r, memory, device));
  return comms;
}

}  // namespace detlogp
