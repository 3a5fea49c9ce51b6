// The helpers of the public value types (tensor views, provenance), used by every layer.
#include "detlogp/tensor.hpp"

#include <sstream>

#include "detlogp/detlogp.hpp"

namespace detlogp {
namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  int size;  // bytes
};
constexpr DTypeInfo kDTypes[] = {
    {DType::bf16, "bf16", 2}, {DType::f32, "f32", 4}, {DType::i32, "i32", 4}, {DType::i64, "i64", 8}};

const DTypeInfo* find_dtype(DType d) {
  for (const DTypeInfo& info : kDTypes)
    if (info.dtype == d) return &info;
  return nullptr;
}

}  // namespace

const char* dtype_name(DType d) {
  const DTypeInfo* info = find_dtype(d);
  return info ? info->name : "?";
}

int dtype_size(DType d) {
  const DTypeInfo* info = find_dtype(d);
  return info ? info->size : 0;
}

int64_t shard_tiles(int64_t vocab_local) { return (vocab_local + kVocabTile - 1) / kVocabTile; }

std::string to_string(const Provenance& p) {
  std::ostringstream os;
  os << "contract=" << p.contract_name << " v" << p.contract_version << " backend=" << p.backend_id
     << " arch=" << p.arch << " cc=" << p.cc << " VOCAB_TILE=" << p.vocab_tile << " K_SLAB=" << p.k_slab
     << " n_split=\"" << p.n_split_policy << "\" tree=" << p.tree_id << " transcendental=" << p.transcendental_id
     << " temperature=" << p.temperature_id;
  if (!p.entropy_id.empty()) os << " entropy=" << p.entropy_id;
  if (!p.sample_id.empty()) os << " sample=" << p.sample_id;
  return os.str();
}

}  // namespace detlogp
