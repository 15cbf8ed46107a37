// The per-request `sparse` field -> the engine's per-sequence attention: validates the
// method and its options through the sparse registry (src/sparse/registry.h) when the
// request arrives (so mistakes are 400s), and hands the scheduler a maker that builds a
// SparseSession for the sequence when it is admitted. Methods are built once per distinct
// configuration and shared (they hold only configuration).
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "engine/request.h"
#include "server/openai_request.h"

namespace spade::sparse {
class SparseMethod;
}

namespace spade::server {

struct ResolvedSparse {
  std::string method;      // metrics label
  std::string description; // method with effective parameters
  AttentionMaker maker;    // empty: dense attention (the "full" method without options)
  // GPU: the method the model runs for this request (null: the server's own method).
  std::shared_ptr<const sparse::SparseConfig> device_method;
  int64_t correction_every = 0;  // the method's cache correction (EngineRequest::correction_every)
};

class SparseMethods {
 public:
  // `fallback`: the server's default (from flags) for requests without `sparse`.
  // `kv`: the CPU pool sparse sessions read. A server on the GPU passes nullptr, its device
  // name in `device`, and `device_check` (throws for a method the GPU model cannot run): the
  // model runs each request's method itself (ResolvedSparse::device_method; null for the
  // server's own method), so requests resolve with no session.
  using DeviceCheck = std::function<void(const sparse::SparseConfig&)>;
  SparseMethods(const ModelConfig& cfg, KVPool* kv, SparseSpec fallback,
                std::string device = {}, DeviceCheck device_check = {});
  // Throws spade::Error naming the method / option when the spec is invalid.
  ResolvedSparse resolve(const std::optional<SparseSpec>& spec);
  const SparseSpec& fallback() const { return fallback_; }

 private:
  const ModelConfig& cfg_;
  KVPool* kv_;
  SparseSpec fallback_;
  std::string device_;       // non-empty: the model runs fallback_ itself (GPU)
  std::string device_key_;  // fallback_'s resolved configuration
  DeviceCheck device_check_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<const sparse::SparseMethod>> cache_;
};

}  // namespace spade::server
