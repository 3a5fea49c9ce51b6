#include "golden/report.hpp"

#include <cmath>
#include <cstdio>
#include <sstream>

#include "detlogp/fpops.hpp"
#include "io/json.hpp"

namespace detlogp::golden {

namespace {

using io::json_quote;

std::string hex_bits(float x) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", fp::bits(x));
  return buf;
}

// A JSON number with 17 significant digits (every double round-trips); null for NaN and inf,
// which JSON lacks.
std::string num(double x) {
  if (!std::isfinite(x)) return "null";
  std::ostringstream os;
  os.precision(17);
  os << x;
  return os.str();
}

std::string metrics_json(const Metrics& m) {
  std::ostringstream o;
  o << "{\"total\": " << m.total << ", \"mismatch_count\": " << m.mismatch_count
    << ", \"train_rollout_logprob_abs_diff\": " << num(m.train_rollout_logprob_abs_diff)
    << ", \"current_rollout_logprob_max_abs_diff\": " << num(m.current_rollout_logprob_max_abs_diff)
    << ", \"k3_max\": " << num(m.k3_max) << ", \"k3_mean\": " << num(m.k3_mean) << ", \"k3_nonzero\": " << m.k3_nonzero
    << "}";
  return o.str();
}

std::string entropy_json(const HarnessRun& run, const HarnessResult& res) {
  if (!res.entropy_compared) return "null";
  const EntropyMetrics& m = res.entropy;
  std::ostringstream o;
  o << "{\"total\": " << m.total << ", \"mismatch_count\": " << m.mismatch_count
    << ", \"mean_abs_diff\": " << num(m.mean_abs_diff) << ", \"max_abs_diff\": " << num(m.max_abs_diff)
    << ", \"rollout\": \"reduce_logits over the served logits\", \"trainer\": " << json_quote(run.trainer_entropy_how)
    << ", \"serving_readback_checked\": " << run.entropy_readback_checked
    << ", \"serving_readback_mismatch\": " << run.entropy_readback_mismatch << "}";
  return o.str();
}

// The entropy row's claim in words: exact, not exact, or why it was not compared.
std::string entropy_claim(const HarnessResult& res) {
  if (!res.entropy_compared) return "not compared (" + res.entropy_note + ")";
  return res.entropy_exact ? "exact zero" : "NOT exact";
}

std::string placement_text(const HarnessConfig& cfg) {
  std::string s = cfg.devices.empty() ? "in-process host ranks" : "CUDA devices";
  for (size_t i = 0; i < cfg.devices.size(); ++i) {
    s += i ? "," : " ";
    s += std::to_string(cfg.devices[i]);
  }
  if (!cfg.devices.empty()) s += " over NCCL";
  return s;
}

}  // namespace

std::string report_json(const HarnessConfig& cfg, const HarnessRun& run, const HarnessResult& res) {
  const SideReadback &rollout = run.rollout, &trainer = run.trainer;
  std::ostringstream j;
  j << "{\n  \"format\": \"detlogp-validation-report-v1\",\n  \"detlogp_version\": " << json_quote(version_string())
    << ",\n  \"config\": {\"seqs\": " << cfg.seqs << ", \"max_len\": " << cfg.max_len
    << ", \"max_batch\": " << cfg.max_batch << ", \"d\": " << cfg.dim << ", \"v\": " << cfg.weight_rows
    << ", \"real_vocab\": " << run.real_vocab << ", \"tp\": " << cfg.tp << ", \"cp\": " << cfg.cp
    << ", \"rollout_tp\": " << cfg.rollout_tp << ", \"devices\": " << json_quote(placement_text(cfg))
    << ", \"seed\": " << cfg.seed << ", \"perturb_trainer_weight\": " << (cfg.perturb_trainer_weight ? "true" : "false")
    << "},\n"
    << "  \"rollout\": {\"entry\": \"serving\", \"tp\": " << cfg.rollout_tp
    << ", \"backend\": " << json_quote(rollout.backend) << ", \"provenance\": " << json_quote(rollout.provenance)
    << ", \"calls\": " << rollout.calls << ", \"fallbacks\": " << rollout.fallbacks
    << ", \"weight_fingerprint\": " << json_quote(run.rollout_fingerprint) << ", \"steps\": " << run.steps
    << ", \"max_batch_observed\": " << run.max_active << ", \"distinct_batch_sizes\": " << run.distinct_batch_sizes
    << ", \"membership_changes\": " << run.membership_changes
    << ", \"lse_readback_mismatch\": " << run.lse_readback_mismatch << "},\n"
    << "  \"trainer\": {\"entry\": \"trainer\", \"tp\": " << cfg.tp << ", \"cp\": " << cfg.cp
    << ", \"packed_rows\": " << run.total() << ", \"backend\": " << json_quote(trainer.backend)
    << ", \"provenance\": " << json_quote(trainer.provenance) << ", \"calls\": " << trainer.calls
    << ", \"fallbacks\": " << trainer.fallbacks << ", \"weight_fingerprint\": " << json_quote(run.trainer_fingerprint)
    << "},\n"
    << "  \"weight_fingerprints_match\": " << (run.same_weights() ? "true" : "false") << ",\n";
  if (!res.compared) {
    j << "  \"logp\": null,\n  \"entropy\": null,\n  \"negative_control_bf16_logits\": null,\n"
      << "  \"claim\": {\"logp_exact_zero\": false, \"entropy_exact_zero\": false, \"reason\": \"weight fingerprints "
         "differ: not compared\"}\n}\n";
    return j.str();
  }
  if (cfg.sampling)
    j << "  \"sampling\": {\"program\": \"sample/v1\", \"logp\": \"processed\", \"logp_raw\": " << metrics_json(res.raw)
      << ", \"replay_outside_support\": " << run.replay_outside_support
      << ", \"control_filtered_token\": " << run.control_filtered
      << ", \"negative_control\": \"engine sampler: bf16 logits, /T, sort-based top-k/top-p, min-p, softmax "
         "renormalization\"},\n";
  j << "  \"logp\": " << metrics_json(res.metrics) << ",\n  \"entropy\": " << entropy_json(run, res) << ",\n  \""
    << (cfg.sampling ? "negative_control_engine_sampler" : "negative_control_bf16_logits")
    << "\": " << metrics_json(res.control) << ",\n  \"claim\": {\"logp_exact_zero\": " << (res.exact ? "true" : "false")
    << ", \"entropy_exact_zero\": " << (res.entropy_compared ? (res.entropy_exact ? "true" : "false") : "null");
  if (!res.entropy_compared) j << ", \"entropy_not_compared\": " << json_quote(res.entropy_note);
  j << ", \"negative_control_drift\": " << (res.control_drift ? "true" : "false") << "},\n  \"tokens\": [\n";
  for (int64_t i = 0; i < run.total(); ++i) {
    const size_t k = static_cast<size_t>(i);
    j << "    {\"seq\": " << run.where[k].first << ", \"pos\": " << run.where[k].second
      << ", \"token\": " << run.tokens[k] << ", \"T\": " << num(run.temperatures[k])
      << ", \"logp_rollout\": " << json_quote(hex_bits(run.rollout_logp[k]))
      << ", \"logp_trainer\": " << json_quote(hex_bits(run.trainer_logp[k])) << ", \"k3\": " << num(run.k3[k])
      << ", \"logp_control\": " << json_quote(hex_bits(run.control_logp[k]))
      << ", \"k3_control\": " << num(run.control_k3[k]);
    if (cfg.sampling)
      j << ", \"top_k\": " << run.top_k[k] << ", \"top_p\": " << num(run.top_p[k])
        << ", \"min_p\": " << num(run.min_p[k])
        << ", \"logp_raw_rollout\": " << json_quote(hex_bits(run.rollout_logp_raw[k]))
        << ", \"logp_raw_trainer\": " << json_quote(hex_bits(run.trainer_logp_raw[k]));
    if (res.entropy_compared)
      j << ", \"entropy_rollout\": " << json_quote(hex_bits(run.rollout_entropy[k]))
        << ", \"entropy_trainer\": " << json_quote(hex_bits(run.trainer_entropy[k]));
    j << "}" << (i + 1 < run.total() ? "," : "") << "\n";
  }
  j << "  ]\n}\n";
  return j.str();
}

std::string report_markdown(const HarnessConfig& cfg, const HarnessRun& run, const HarnessResult& res) {
  const SideReadback &rollout = run.rollout, &trainer = run.trainer;
  const std::string &rollout_fp = run.rollout_fingerprint, &trainer_fp = run.trainer_fingerprint;
  const int64_t total = run.total();
  std::ostringstream md;
  md << "# detlogp validation report: rollout vs trainer (L4/L5)\n\n"
     << "detlogp " << version_string() << "; config: " << cfg.seqs << " sequences, max length " << cfg.max_len
     << ", max batch " << cfg.max_batch << ", D=" << cfg.dim << ", V=" << cfg.weight_rows << " (real " << run.real_vocab
     << "), rollout TP=" << cfg.rollout_tp << ", trainer TP=" << cfg.tp << " x CP=" << cfg.cp << ", ranks on "
     << placement_text(cfg) << ", seed " << cfg.seed << ".\n\n"
     << "| side | entry | backend | fallback | weight fingerprint | calls |\n|---|---|---|---|---|---|\n"
     << "| rollout | serving, TP=" << cfg.rollout_tp << ", continuous batching (" << run.steps
     << " steps, membership changed on " << run.membership_changes << ", batch 1.." << run.max_active << ") | `"
     << rollout.backend << "` | " << (rollout.fallbacks ? "**yes**" : "none observed") << " | `"
     << rollout_fp.substr(0, 16) << "` | " << rollout.calls << " |\n"
     << "| trainer | trainer, packed " << total << " rows, TP=" << cfg.tp << " x CP=" << cfg.cp << " | `"
     << trainer.backend << "` | " << (trainer.fallbacks ? "**yes**" : "none observed") << " | `"
     << trainer_fp.substr(0, 16) << "` | " << trainer.calls << " |\n\n"
     << "Provenance (rollout): `" << rollout.provenance << "`\n\nProvenance (trainer): `" << trainer.provenance
     << "`\n\n";
  if (!res.compared) {
    md << "**Weight fingerprints differ (" << rollout_fp << " vs " << trainer_fp
       << "): the logprobs were not compared.**\n";
    return md.str();
  }
  auto row = [&](const std::string& name, const Metrics& m) {
    md << "| " << name << " | " << num(m.train_rollout_logprob_abs_diff) << " | "
       << num(m.current_rollout_logprob_max_abs_diff) << " | " << m.mismatch_count << " / " << m.total << " | "
       << num(m.k3_max) << " | " << m.k3_nonzero << " |\n";
  };
  md << "| row | train_rollout_logprob_abs_diff (mean) | current_rollout_logprob_max_abs_diff | mismatch_count / "
        "total | K3 max | K3 != 0 |\n|---|---|---|---|---|---|\n";
  row(cfg.sampling ? "processed logp (sample/v1 rollout, replayed by the trainer)" : "logp (detlogp both sides)",
      res.metrics);
  if (cfg.sampling) row("raw logp (the same tokens at T, no filter)", res.raw);
  if (res.entropy_compared)
    md << "| entropy (rollout vs trainer, detlogp both sides) | " << num(res.entropy.mean_abs_diff) << " | "
       << num(res.entropy.max_abs_diff) << " | " << res.entropy.mismatch_count << " / " << res.entropy.total
       << " | - | - |\n";
  else
    md << "| entropy (rollout vs trainer) | not compared | | | | |\n";
  row(cfg.sampling ? "negative control (an engine's sampler: bf16 logits, sort-based top-k/top-p, min-p)"
                   : "negative control (bf16 logits + log_softmax)",
      res.control);
  if (cfg.sampling)
    md << "\nSampling program `sample/v1` with per-sequence T (greedy included), top-k, top-p and min-p; the "
          "trainer replays it (linear_logp with a SamplingProgram, TP="
       << cfg.tp << " over V / TP shards); targets outside the replayed support: " << run.replay_outside_support
       << "; tokens the engine sampler's control filtered out: " << run.control_filtered << ".\n";
  md << "\n**logp claim: " << (res.exact ? "exact zero" : "NOT exact") << "**: " << res.metrics.mismatch_count << " of "
     << res.metrics.total << " tokens differ in bits, K3 = rho - 1 - log(rho) is " << num(res.metrics.k3_max)
     << " at most; backed by the readback above: rollout `" << rollout.backend << "` and trainer `" << trainer.backend
     << "`, " << (run.fallback_free() ? "no fallback observed" : "A FALLBACK WAS OBSERVED")
     << " on either side, serving lse == reducer lse on " << (total - run.lse_readback_mismatch) << " / " << total
     << " tokens, weight fingerprint `" << rollout_fp << "` on both sides.\n\n"
     << "**entropy claim: " << entropy_claim(res) << "**";
  if (res.entropy_compared)
    md << ": " << res.entropy.mismatch_count << " of " << res.entropy.total << " tokens differ in bits (max |diff| "
       << num(res.entropy.max_abs_diff)
       << "); rollout: the contract reducer over the served logits, trainer: " << run.trainer_entropy_how
       << "; serving entropy == reducer entropy on " << (run.entropy_readback_checked - run.entropy_readback_mismatch)
       << " / " << run.entropy_readback_checked << " tokens"
       << (run.entropy_readback_checked == 0 ? " (the serving calls gave none)" : "");
  md << ".\n\n"
     << "Negative control: the same rollout scored the materializing way drifts on " << res.control.mismatch_count
     << " / " << res.control.total << " tokens (max |diff| " << num(res.control.current_rollout_logprob_max_abs_diff)
     << ").\n";
  return md.str();
}

void log_summary(const HarnessConfig& cfg, const HarnessRun& run, const HarnessResult& res, std::ostream& log) {
  log << "rollout: " << run.steps << " steps (membership changed on " << run.membership_changes << "), "
      << run.batch_calls << " serving calls, batch sizes 1.." << run.max_active << ", " << run.total()
      << " tokens; backend " << run.rollout.backend << "\n";
  log << "trainer: packed " << run.total() << " rows, TP=" << cfg.tp << " x CP=" << cfg.cp
      << " (rollout TP=" << cfg.rollout_tp << "), ranks on " << placement_text(cfg) << ", backend "
      << run.trainer.backend << "\n";
  log << "weight fingerprint: rollout " << run.rollout_fingerprint << ", trainer " << run.trainer_fingerprint
      << (run.same_weights() ? " (match)" : " (MISMATCH: not compared)") << "\n";
  if (!res.compared) return;
  if (cfg.sampling)
    log << "sampling program sample/v1: raw logp mismatch " << res.raw.mismatch_count << "/" << res.raw.total
        << ", max_abs_diff " << num(res.raw.current_rollout_logprob_max_abs_diff) << ", replay outside support "
        << run.replay_outside_support << ", control filtered " << run.control_filtered << "\n";
  log << "logp: mismatch " << res.metrics.mismatch_count << "/" << res.metrics.total << ", abs_diff(mean) "
      << num(res.metrics.train_rollout_logprob_abs_diff) << ", max_abs_diff "
      << num(res.metrics.current_rollout_logprob_max_abs_diff) << ", K3 max " << num(res.metrics.k3_max) << "\n";
  if (res.entropy_compared)
    log << "entropy: mismatch " << res.entropy.mismatch_count << "/" << res.entropy.total << ", abs_diff(mean) "
        << num(res.entropy.mean_abs_diff) << ", max_abs_diff " << num(res.entropy.max_abs_diff)
        << ", serving readback mismatch " << run.entropy_readback_mismatch << "/" << run.entropy_readback_checked
        << "\n";
  else
    log << "entropy: not compared (" << res.entropy_note << ")\n";
  log << "negative control (bf16 logits): mismatch " << res.control.mismatch_count << "/" << res.control.total
      << ", abs_diff(mean) " << num(res.control.train_rollout_logprob_abs_diff) << ", max_abs_diff "
      << num(res.control.current_rollout_logprob_max_abs_diff) << ", K3 max " << num(res.control.k3_max) << "\n";
}

}  // namespace detlogp::golden
