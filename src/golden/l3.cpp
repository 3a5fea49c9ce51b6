// Validation ladder L3: the golden inputs through a trainer-shaped and a rollout-shaped call, each
// side in its own process writing a result file, and the byte check between two such files.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>

#include "detlogp/fpops.hpp"
#include "golden/goldens.hpp"
#include "golden/harness.hpp"
#include "golden/readback.hpp"
#include "io/file.hpp"
#include "io/safetensors.hpp"

namespace detlogp::golden {

namespace {

using io::ElementType;
using io::HostTensor;

HostTensor f32_tensor(const std::vector<float>& v) {
  HostTensor t = HostTensor::zeros(ElementType::f32, {static_cast<int64_t>(v.size())});
  if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * 4);
  return t;
}

std::vector<const GoldenCase*> select_cases(const std::vector<std::string>& names) {
  std::vector<const GoldenCase*> out;
  for (const GoldenCase& c : golden_cases())
    if (names.empty() || std::find(names.begin(), names.end(), c.name) != names.end()) out.push_back(&c);
  for (const std::string& n : names) {
    bool found = false;
    for (const GoldenCase* c : out) found |= c->name == n;
    DETLOGP_CHECK(found, "unknown golden case '" << n << "'");
  }
  return out;
}

}  // namespace

void l3_run_side(L3Side side, const std::vector<std::string>& names, int tp, const CallOptions& opt,
                 const std::string& out_path, std::ostream& log) {
  DETLOGP_CHECK(tp >= 1, "--tp=" << tp << " must be >= 1");
  io::SafetensorsContents file;
  SideReadback rb;
  for (const GoldenCase* c : select_cases(names)) {
    const CaseInputs in = make_inputs(*c);
    std::vector<float> logp(static_cast<size_t>(c->rows)), lse(static_cast<size_t>(c->rows));
    int ranks = 0;
    if (side == L3Side::trainer) {
      // One packed batch over `tp` vocabulary shards, trainer entry (no logits anywhere).
      std::vector<Shard> shards;
      for (auto [start, count] : shard_ranges(c->weight_rows, tp)) {
        const LinearLogpInputs v = in.view(start, count);
        shards.push_back({start, v.weight, v.bias});
        ranks += count > 0 ? 1 : 0;
      }
      run_tensor_parallel(in.view(), shards, logp.data(), lse.data(), opt, rb);
    } else {
      // One row at a time through the serving entry (logits [1, V] for the sampler).
      std::vector<float> logits(static_cast<size_t>(c->weight_rows));
      for (int64_t n = 0; n < c->rows; ++n) {
        LinearLogpInputs v = in.view();
        v.hidden = TensorView::matrix(in.hidden.data() + n * c->dim, DType::bf16, 1, c->dim);
        v.targets = c->targets_i32 ? TensorView::vector(in.targets32.data() + n, DType::i32, 1)
                                   : TensorView::vector(in.targets.data() + n, DType::i64, 1);
        if (c->temperature_rows) v.temperature_rows = TensorView::vector(in.temperatures.data() + n, DType::f32, 1);
        const size_t i = static_cast<size_t>(n);
        rb.add(linear_logp(v,
                           {mutable_vector(&logp[i], DType::f32, 1), mutable_vector(&lse[i], DType::f32, 1),
                            mutable_matrix(logits.data(), DType::f32, 1, c->weight_rows)},
                           opt));
      }
    }
    file.add(c->name + "/logp", f32_tensor(logp));
    file.add(c->name + "/lse", f32_tensor(lse));
    file.metadata[c->name + "/inputs_sha256"] = in.inputs_sha256();
    file.metadata[c->name + "/weight_fingerprint"] = in.weight_fingerprint;
    log << "  " << c->name << ": N=" << c->rows << " D=" << c->dim << " V=" << c->weight_rows
        << (side == L3Side::trainer ? " packed, TP=" + std::to_string(ranks) + " (non-empty shards), trainer entry"
                                    : std::string(" one row at a time, serving entry"))
        << "\n";
  }
  file.metadata["format"] = "detlogp-l3-v1";
  file.metadata["side"] = side == L3Side::trainer ? "trainer" : "rollout";
  file.metadata["producer"] = "detlogp-cli";
  file.metadata["pid"] = std::to_string(::getpid());
  file.metadata["backend"] = rb.backend;
  file.metadata["provenance"] = rb.provenance;
  file.metadata["calls"] = std::to_string(rb.calls);
  file.metadata["fallback"] = rb.fallbacks == 0 ? "no" : rb.fallback_reason;
  io::write_safetensors(out_path, file);
  log << "side " << file.metadata["side"] << ": " << rb.calls << " calls, backend " << rb.backend << ", fallback "
      << file.metadata["fallback"] << ", pid " << file.metadata["pid"] << "\nwrote: " << out_path << "\n";
}

bool l3_check(const std::string& a_path, const std::string& b_path, std::ostream& log) {
  const io::SafetensorsContents a = io::read_safetensors(a_path), b = io::read_safetensors(b_path);
  auto meta = [](const io::SafetensorsContents& f, const std::string& k) {
    auto it = f.metadata.find(k);
    return it == f.metadata.end() ? std::string("(missing)") : it->second;
  };
  for (const auto* f : {&a, &b})
    DETLOGP_CHECK(meta(*f, "format") == "detlogp-l3-v1", "'" << (f == &a ? a_path : b_path)
                                                             << "' is not a detlogp-l3-v1 file (format "
                                                             << meta(*f, "format") << ")");
  bool ok = true;
  for (const auto* f : {&a, &b}) {
    log << "side " << meta(*f, "side") << " (" << (f == &a ? a_path : b_path) << "): producer " << meta(*f, "producer")
        << ", pid " << meta(*f, "pid") << ", backend " << meta(*f, "backend") << ", fallback " << meta(*f, "fallback")
        << "\n  provenance: " << meta(*f, "provenance") << "\n";
    if (meta(*f, "fallback") != "no") ok = false;
  }
  if (meta(a, "pid") == meta(b, "pid") && meta(a, "producer") == meta(b, "producer")) {
    log << "  FAIL  both sides report the same process id: not two processes\n";
    ok = false;
  }
  std::set<std::string> cases;
  for (const auto* f : {&a, &b})
    for (const auto& t : f->tensors)
      if (t.name.size() > 5 && t.name.ends_with("/logp")) cases.insert(t.name.substr(0, t.name.size() - 5));
  for (const std::string& c : cases) {
    const HostTensor *la = a.find(c + "/logp"), *lb = b.find(c + "/logp");
    const HostTensor *sa = a.find(c + "/lse"), *sb = b.find(c + "/lse");
    std::string verdict;
    if (!la || !lb || !sa || !sb) {
      verdict = "FAIL  present on one side only";
    } else if (meta(a, c + "/weight_fingerprint") != meta(b, c + "/weight_fingerprint")) {
      verdict = "FAIL  weight fingerprints differ (" + meta(a, c + "/weight_fingerprint").substr(0, 16) + " vs " +
                meta(b, c + "/weight_fingerprint").substr(0, 16) + "): not compared";
    } else if (meta(a, c + "/inputs_sha256") != meta(b, c + "/inputs_sha256")) {
      verdict = "FAIL  inputs differ: not compared";
    } else if (la->bytes != lb->bytes || sa->bytes != sb->bytes) {
      const auto* pa = reinterpret_cast<const float*>(la->bytes.data());
      const auto* pb = reinterpret_cast<const float*>(lb->bytes.data());
      int64_t diff = 0;
      const size_t n = std::min(la->bytes.size(), lb->bytes.size()) / 4;
      for (size_t i = 0; i < n; ++i) diff += fp::bits(pa[i]) != fp::bits(pb[i]);
      verdict = "FAIL  " + std::to_string(diff) + " of " + std::to_string(n) + " logp differ" +
                (sa->bytes != sb->bytes ? " (lse differs too)" : "");
    } else {
      verdict = "PASS  " + std::to_string(la->bytes.size() / 4) + " rows: logp and lse bytes identical, weight " +
                meta(a, c + "/weight_fingerprint").substr(0, 16);
    }
    if (verdict.rfind("PASS", 0) != 0) ok = false;
    std::string name = c;
    name.append(24 - std::min<size_t>(24, name.size()), ' ');
    log << "  " << name << verdict << "\n";
  }
  if (cases.empty()) {
    log << "  FAIL  no cases\n";
    ok = false;
  }
  log << "verdict: " << (ok ? "PASS" : "FAIL") << "\n";
  return ok;
}

void l3_export_inputs(const std::vector<std::string>& names, const std::string& dir, std::ostream& log) {
  const std::vector<const GoldenCase*> cases = select_cases(names);
  io::ensure_directory(dir);
  for (const GoldenCase* c : cases) {
    const CaseInputs in = make_inputs(*c);
    io::SafetensorsContents f;
    HostTensor hidden = HostTensor::zeros(ElementType::bf16, {c->rows, c->dim});
    std::memcpy(hidden.data(), in.hidden.data(), in.hidden.size() * 2);
    HostTensor weight = HostTensor::zeros(ElementType::bf16, {c->weight_rows, c->dim});
    std::memcpy(weight.data(), in.weight.data(), in.weight.size() * 2);
    HostTensor targets = HostTensor::zeros(c->targets_i32 ? ElementType::i32 : ElementType::i64, {c->rows});
    if (c->targets_i32)
      std::memcpy(targets.data(), in.targets32.data(), in.targets32.size() * 4);
    else
      std::memcpy(targets.data(), in.targets.data(), in.targets.size() * 8);
    f.add("hidden", std::move(hidden));
    f.add("weight", std::move(weight));
    f.add("targets", std::move(targets));
    if (!in.bias.empty()) f.add("bias", f32_tensor(in.bias));
    if (c->temperature_rows) {
      f.add("temperature", f32_tensor(in.temperatures));
    } else {
      HostTensor t = HostTensor::zeros(ElementType::f32, {});
      std::memcpy(t.data(), &c->temperature, 4);
      f.add("temperature", std::move(t));
    }
    f.metadata["case"] = c->name;
    f.metadata["real_vocab"] = std::to_string(c->real_vocab);
    f.metadata["ignore_index"] = std::to_string(c->ignore_index);
    f.metadata["inputs_sha256"] = in.inputs_sha256();
    f.metadata["weight_fingerprint"] = in.weight_fingerprint;
    const std::string path = (std::filesystem::path(dir) / (c->name + ".safetensors")).string();
    io::write_safetensors(path, f);
    log << "wrote: " << path << " (real_vocab " << c->real_vocab << ", ignore_index " << c->ignore_index << ")\n";
  }
}

}  // namespace detlogp::golden
