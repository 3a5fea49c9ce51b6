// Small shapes through every launch bucket, both entries and partial mode: fully written outputs,
// CPU reduce_logits re-reduction bit-identical. Fast enough to run under compute-sanitizer
// (memcheck, racecheck, synccheck) in scripts/gpu_check.sh.
#include <cstdio>

#include "gpu_test_util.hpp"

using namespace gput;

int main() {
  if (int rc = skip_unless_sm90("test_sm90_small")) return rc;
  struct S {
    int64_t n, d, v;
  };
  const S shapes[] = {{37, 64, 2053}, {3, 72, 130}, {130, 128, 300}};
  for (const auto& s : shapes)
    for (const std::string& name : sm90_bucket_names()) {
      const char* bucket = name.c_str();
      EnvGuard env("DETLOGP_SM90_BUCKET", bucket);
      DeviceModel m;
      m.make(s.d, s.v, 3, true);
      DevBuf<uint16_t> hidden(static_cast<size_t>(s.n * s.d));
      fill_bf16_uniform(hidden.get(), s.n * s.d, 4, 1.0f);
      std::vector<int32_t> t(static_cast<size_t>(s.n));
      for (int64_t i = 0; i < s.n; ++i) t[i] = i % 4 == 1 ? -100 : static_cast<int32_t>((i * 977) % s.v);
      DevBuf<int32_t> dt(t.size());
      dt.from_host(t);
      Outputs o;
      o.make(s.n, s.v, true);
      auto p = device_problem(m, hidden.get(), s.n, dt.get(), o);
      try {
        sm90().run(p);
      } catch (const std::exception& e) {
        GPU_EXPECT(false, bucket << " N=" << s.n << ": " << e.what());
        continue;
      }
      GPU_EXPECT(count_poison(o.logits.get(), s.n * s.v) == 0 && count_poison(o.logp.get(), s.n) == 0 &&
                     count_poison(o.lse.get(), s.n) == 0,
                 bucket << " N=" << s.n << " V=" << s.v << ": outputs not fully written");
      const auto z = o.logits.to_host();
      std::vector<float> lp(s.n), ls(s.n);
      detlogp::ReduceLogitsInputs ri;
      ri.logits = detlogp::TensorView::matrix(z.data(), detlogp::DType::f32, s.n, s.v);
      ri.targets = detlogp::TensorView::vector(t.data(), detlogp::DType::i32, s.n);
      detlogp::reduce_logits(ri, detlogp::mutable_vector(lp.data(), detlogp::DType::f32, s.n),
                             detlogp::mutable_vector(ls.data(), detlogp::DType::f32, s.n));
      auto a = detlogp::bitcmp::compare(lp, o.logp.to_host()), b = detlogp::bitcmp::compare(ls, o.lse.to_host());
      GPU_EXPECT(a.identical() && b.identical(),
                 bucket << " N=" << s.n << ": " << a.describe("logp") << "; " << b.describe("lse"));

      // Partial mode over the whole shard.
      const int64_t tiles = (s.v + 63) / 64;
      DevBuf<detlogp::TileSummary> sums(static_cast<size_t>(s.n * tiles));
      DevBuf<float> tl(static_cast<size_t>(s.n));
      DevBuf<uint8_t> owned(static_cast<size_t>(s.n));
      Outputs none;
      auto pp = device_problem(m, hidden.get(), s.n, dt.get(), none);
      pp.logp = pp.lse = nullptr;
      pp.summaries = sums.get();
      pp.target_logit = tl.get();
      pp.target_owned = owned.get();
      sm90().run(pp);
      GPU_CUDA(cudaDeviceSynchronize());
    }
  return finish("test_sm90_small");
}
