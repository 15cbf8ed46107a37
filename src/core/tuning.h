// The engine's tuning knobs from the environment: every SPADE_* variable that changes what the
// engine runs is read and checked once (first use of tuning()) into one struct, so no kernel
// file reads the environment itself. docs/tuning.md is their table. A value that does not parse
// or is out of range is a clear error (spade::Error naming the variable), never ignored.
// (SPADE_API_KEY is a server setting, read by `spade serve`; SPADE_SANITIZED and the SPADE_*
// variables of bench/ and tests/ belong to those tools.)
#pragma once
#include <cstdlib>
#include <functional>
#include <string>

#include "core/error.h"

namespace spade {

struct Tuning {
  int threads = 0;                 // SPADE_THREADS: CPU thread pool size, [1, 1024]; 0 = unset
  bool deterministic = false;      // SPADE_DETERMINISTIC: any value but 0 = static decode schedule
  int fused_gemv = -1;             // SPADE_FUSED_GEMV: bit mask [0, 3] of the decode GEMV fusions
  int gemv_max_m = -1;             // SPADE_GEMV: rows up to which projections take the GEMV, >= 0
  bool pdl = true;                 // SPADE_PDL=0: no programmatic dependent launch
  bool gemv_rotate = true;         // SPADE_GEMV_ROTATE=0: the decode GEMV without its row rotation
  bool prefill_tma = true;         // SPADE_PREFILL_TMA=0: prefill K/V tiles by cp.async, not TMA
  bool tma = true;                 // SPADE_TMA=0: no TMA load anywhere (the prefill's)
  int attn_decode = -1;            // SPADE_ATTN_DECODE: decode attention variant, >= 0
  int attn_prefill = -1;           // SPADE_ATTN_PREFILL: prefill kernel, 0 (generic) .. 2
  bool fp8_direct = true;          // SPADE_FP8_DIRECT=0: the fp8 decode kernel widens the codes
                                   // through an f16 tile (A/B); 1 (default): in registers (D = 128)
  int twilight_est_tiles = -1;     // SPADE_TWL_EST_TPW: Twilight estimate tiles per warp, >= 1
  int graph_min_uses = -1;         // SPADE_GRAPH_MIN_USES: capture a decode launch shape the
                                   // n-th time it occurs, [1, 64] (CudaModelOptions)
  std::string graph_log;           // SPADE_GRAPH_LOG: file each CUDA graph capture's launch
                                   // shape is appended to (diagnostics)
  int emulate_cc = 0;              // SPADE_EMULATE_CC: run as a GPU of compute capability 80, 86
                                   // or 89 (its shared memory, no Hopper kernels); 0 = the device's
};

namespace tuning_detail {
using Getenv = std::function<const char*(const char*)>;

// An integer in [lo, hi] from variable `name`, or `unset` when it is absent or empty.
inline int int_var(const Getenv& get, const char* name, long long lo, long long hi, int unset) {
  const char* s = get(name);
  if (!s || !*s) return unset;
  const bool digits = (s[0] >= '0' && s[0] <= '9') || (s[0] == '-' && s[1] >= '0' && s[1] <= '9');
  char* end = nullptr;
  const long long v = digits ? std::strtoll(s, &end, 10) : 0;
  SPADE_CHECK(digits && end && *end == '\0' && v >= lo && v <= hi, name, " must be an integer in [", lo,
              ", ", hi, "], got '", s, "'");
  return int(v);
}

// "0" = off, "1" = on; absent or empty = `unset`.
inline bool switch_var(const Getenv& get, const char* name, bool unset) {
  const char* s = get(name);
  if (!s || !*s) return unset;
  const std::string v(s);
  SPADE_CHECK(v == "0" || v == "1", name, " must be 0 or 1, got '", v, "'");
  return v == "1";
}
}  // namespace tuning_detail

// The tuning `get` describes (tests): get(name) returns the value or null. Header-only, so the
// CUDA library and the rest link it in any order.
inline Tuning parse_tuning(const tuning_detail::Getenv& get) {
  using namespace tuning_detail;
  Tuning t;
  t.threads = int_var(get, "SPADE_THREADS", 1, 1024, 0);
  t.deterministic = switch_var(get, "SPADE_DETERMINISTIC", false);
  t.fused_gemv = int_var(get, "SPADE_FUSED_GEMV", 0, 3, -1);
  t.gemv_max_m = int_var(get, "SPADE_GEMV", 0, 64, -1);
  t.pdl = switch_var(get, "SPADE_PDL", true);
  t.gemv_rotate = switch_var(get, "SPADE_GEMV_ROTATE", true);
  t.prefill_tma = switch_var(get, "SPADE_PREFILL_TMA", true);
  t.tma = switch_var(get, "SPADE_TMA", true);
  t.attn_decode = int_var(get, "SPADE_ATTN_DECODE", 0, 64, -1);
  t.attn_prefill = int_var(get, "SPADE_ATTN_PREFILL", 0, 2, -1);
  t.fp8_direct = switch_var(get, "SPADE_FP8_DIRECT", true);
  t.twilight_est_tiles = int_var(get, "SPADE_TWL_EST_TPW", 1, 1 << 20, -1);
  t.graph_min_uses = int_var(get, "SPADE_GRAPH_MIN_USES", 1, 64, -1);
  if (const char* f = get("SPADE_GRAPH_LOG")) t.graph_log = f;
  t.emulate_cc = int_var(get, "SPADE_EMULATE_CC", 80, 89, 0);
  SPADE_CHECK(t.emulate_cc == 0 || t.emulate_cc == 80 || t.emulate_cc == 86 || t.emulate_cc == 89,
              "SPADE_EMULATE_CC must be 80, 86 or 89, got ", t.emulate_cc);
  return t;
}

// The process's tuning (the environment at its first use).
inline const Tuning& tuning() {
  static const Tuning t = parse_tuning([](const char* n) -> const char* { return std::getenv(n); });
  return t;
}

}  // namespace spade
