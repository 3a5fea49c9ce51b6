#include "detlogp/tensor.hpp"

#include "detlogp/detlogp.hpp"

namespace detlogp {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::bf16:
      return "bf16";
    case DType::f32:
      return "f32";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
  }
  return "?";
}

int dtype_size(DType d) {
  switch (d) {
    case DType::bf16:
      return 2;
    case DType::f32:
      return 4;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
  }
  return 0;
}

int64_t shard_tiles(int64_t vocab_local) { return (vocab_local + kVocabTile - 1) / kVocabTile; }

std::string version_string() { return DETLOGP_VERSION; }

std::string to_string(const Provenance& p) {
  std::ostringstream os;
  os << "contract=" << p.contract_name << " v" << p.contract_version << " backend=" << p.backend_id
     << " arch=" << p.arch << " cc=" << p.cc << " VOCAB_TILE=" << p.vocab_tile << " K_SLAB=" << p.k_slab
     << " n_split=\"" << p.n_split_policy << "\" tree=" << p.tree_id << " transcendental=" << p.transcendental_id
     << " temperature=" << p.temperature_id;
  return os.str();
}

}  // namespace detlogp
