// The SM90 backend's identity (the backend object itself is reached through the registry,
// detail::sm90_contract_backend in core/backend.hpp).
#pragma once

namespace detlogp::sm90 {

inline constexpr const char* kBackendId = "cuda-fused-linear-logp-sm90-contract-v1";

}  // namespace detlogp::sm90
