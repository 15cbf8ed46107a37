#include "sparse/methods/blasst.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/mmap_file.h"

namespace spade::sparse {

// ---------------------------------------------------------------- stats

void BlasstStats::init(int layers, int hq, int hkv) {
  n_layers = layers;
  n_heads = hq;
  n_kv_heads = hkv;
  prefill.assign(size_t(layers) * size_t(hq), {});
  decode.assign(size_t(layers) * size_t(hkv), {});
  step.assign(size_t(layers) * size_t(hkv), {});
}

void BlasstStats::clear() { init(n_layers, n_heads, n_kv_heads); }

double BlasstStats::ratio(const std::vector<cpu::TileCounts>& v) {
  cpu::TileCounts t;
  for (const auto& c : v) t += c;
  return t.tiles ? double(t.skipped) / double(t.tiles) : 0.0;
}

double BlasstStats::layer_ratio(const std::vector<cpu::TileCounts>& v, int layer, int heads) {
  cpu::TileCounts t;
  for (int h = 0; h < heads; ++h) t += v[size_t(layer * heads + h)];
  return t.tiles ? double(t.skipped) / double(t.tiles) : 0.0;
}

BlasstState* blasst_state(MethodState* state) { return dynamic_cast<BlasstState*>(state); }

const BlasstMethod* as_blasst(const SparseMethod& m) {
  return dynamic_cast<const BlasstMethod*>(&m);
}

namespace {
BlasstState& bl_state(StepContext& c) {
  auto* st = dynamic_cast<BlasstState*>(c.state);
  SPADE_CHECK(st, "blasst: the step context carries no blasst state");
  if (st->stats.n_layers != c.n_layers) st->stats.init(c.n_layers, c.Hq, c.Hkv);
  return *st;
}
}  // namespace

// ---------------------------------------------------------------- method

BlasstMethod::BlasstMethod(std::shared_ptr<const SparseMethod> base, Params prm)
    : ComposedMethod(std::move(base)), prm_(prm) {
  SPADE_CHECK(prm_.lambda >= 0 || prm_.a >= 0, "blasst: give lambda or a");
  SPADE_CHECK(prm_.lambda <= 1, "blasst: lambda ", prm_.lambda, " must be in [0, 1]");
  SPADE_CHECK(prm_.tile > 0 && prm_.prefill_tile > 0 && prm_.q_block > 0,
              "blasst: tile sizes must be positive");
}

std::string BlasstMethod::describe() const {
  std::string lam =
      prm_.lambda >= 0
          ? cat("lambda=", prm_.lambda)
          : cat("lambda=", prm_.a, "/L(", prm_.length_selected ? "selected" : "context",
                ") prefill_lambda=", prm_.prefill_a >= 0 ? prm_.prefill_a : prm_.a, "/L");
  return cat("blasst ", lam, " tile=", prm_.tile, " prefill_tile=", prm_.prefill_tile,
             " q_block=", prm_.q_block, " order=", cpu::tile_order_name(prm_.order),
             " prefill=", prm_.prefill ? "on" : "off", " decode=", prm_.decode ? "on" : "off",
             " over [", base_->describe(), "]");
}

std::unique_ptr<MethodState> BlasstMethod::new_state() const {
  auto st = std::make_unique<BlasstState>();
  st->base = base_->new_state();
  return st;
}

float BlasstMethod::log_lambda(int64_t length, bool prefill) const {
  const double a = prefill && prm_.prefill_a >= 0 ? prm_.prefill_a : prm_.a;
  double lam = prm_.lambda >= 0 ? prm_.lambda : a / double(std::max<int64_t>(1, length));
  lam = std::min(lam, 1.0);
  return lam > 0 ? float(std::log(lam)) : -INFINITY;
}

void BlasstMethod::on_prefill(StepContext& ctx, int64_t p0, int64_t T) const {
  BlasstState& st = bl_state(ctx);
  SPADE_CHECK(!prm_.prefill || st.prefill_layer == ctx.layer,
              "blasst: the session attended layer ", ctx.layer, "'s prefill chunk without the "
              "BLASST attention hook (SparseMethod::attend_prefill)");
  st.prefill_layer = -1;
  ComposedMethod::on_prefill(ctx, p0, T);
}

void BlasstMethod::select(StepContext& ctx, Selection& out) const {
  BlasstState& st = bl_state(ctx);
  SPADE_CHECK(st.pending_layer < 0, "blasst: the session attended layer ", st.pending_layer,
              " without the BLASST attention hook (SparseMethod::attend_decode)");
  ComposedMethod::select(ctx, out);
}

void BlasstMethod::prune(StepContext& ctx, Selection& sel) const {
  ComposedMethod::prune(ctx, sel);
  // A layer whose scores the base asked for is attended by the session's exact kernel.
  if (prm_.decode && !ctx.scores_requested()) bl_state(ctx).pending_layer = ctx.layer;
}

bool BlasstMethod::attend_decode(StepContext& c, const Selection& sel, float* out) const {
  if (!prm_.decode) return false;
  BlasstState& st = bl_state(c);
  float* ll = SelectScratch::ensure(st.log_lambda, size_t(c.Hkv));
  for (int h = 0; h < c.Hkv; ++h) ll[h] = log_lambda(prm_.length_selected ? sel.count(h) : c.L);
  cpu::TileCounts* step = st.stats.step.data() + size_t(c.layer) * size_t(c.Hkv);
  // The skip flags of every tile (the caller's trace too, when it has one).
  std::vector<uint8_t>* flags = st.trace && st.trace->skipped ? st.trace->skipped : &st.skipped;
  const size_t first = st.trace && st.trace->skipped ? flags->size() : 0;
  if (flags == &st.skipped) st.skipped.clear();
  cpu::BlasstTrace tr;
  if (st.trace) tr = *st.trace;
  tr.skipped = flags;
  cpu::attention_blasst_decode(*c.kv, c.layer, *c.pt, c.q, c.Hq, c.scale, sel, ll, prm_.tile,
                               prm_.order, out, st.scratch, step, &tr);
  for (int h = 0; h < c.Hkv; ++h) st.stats.decode[size_t(c.layer * c.Hkv + h)] += step[h];
  // The rows of the kept tiles, head by head (tile j of head h: its selected rows
  // [j * tile, (j + 1) * tile)).
  st.kept.begin_per_head(c.Hkv, sel.length);
  size_t f = first;
  for (int h = 0; h < c.Hkv; ++h) {
    const int64_t n = sel.count(h);
    const int32_t* pos = sel.head(h);
    for (int64_t t0 = 0; t0 < n; t0 += prm_.tile, ++f) {
      SPADE_CHECK(f < flags->size(), "blasst: missing tile flags");
      if ((*flags)[f]) continue;
      for (int64_t i = t0; i < std::min(n, t0 + prm_.tile); ++i) st.kept.push(pos ? pos[i] : int32_t(i));
    }
    st.kept.close_head();
  }
  SPADE_CHECK(f == flags->size(), "blasst: tile flags do not match the selection");
  st.kept_valid = true;
  st.pending_layer = -1;
  return true;
}

const Selection* BlasstMethod::read_selection(StepContext& c) const {
  BlasstState& st = bl_state(c);
  if (!st.kept_valid) return nullptr;
  st.kept_valid = false;
  return &st.kept;
}

bool BlasstMethod::attend_prefill(StepContext& c, const float* q, int64_t p0, int64_t T,
                                  float* out) const {
  if (!prm_.prefill) return false;
  BlasstState& st = bl_state(c);
  const int Hq = c.Hq;
  cpu::TileCounts* counts = st.stats.prefill.data() + size_t(c.layer) * size_t(Hq);  // += per chunk
  cpu::attention_blasst_prefill(*c.kv, c.layer, *c.pt, q, p0, T, Hq, c.scale, log_lambda(p0 + T, true),
                                prm_.prefill_tile, prm_.q_block, prm_.order, out, st.scratch,
                                counts, st.trace);
  st.prefill_layer = c.layer;
  return true;
}

double read_blasst_config_a(const std::string& path, std::string* phase) {
  std::string text;
  try {
    text = read_regular_file(path);  // a FIFO, directory or device: an error, not a hang
  } catch (const Error& e) {
    fail("blasst: cannot read config: ", e.what());
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    fail("blasst: config '", path, "': invalid JSON: ", e.what());
  }
  SPADE_CHECK(j.is_object() && j.contains("a") && j["a"].is_number(), "blasst: config '", path,
              "' has no numeric \"a\" (write it with `spade calibrate blasst`)");
  const double a = j["a"].get<double>();
  SPADE_CHECK(a >= 0, "blasst: config '", path, "': a = ", a, " is negative");
  if (phase) {
    *phase = j.contains("phase") && j["phase"].is_string() ? j["phase"].get<std::string>()
                                                            : "decode";
    SPADE_CHECK(*phase == "prefill" || *phase == "decode", "blasst: config '", path,
                "': phase must be prefill or decode");
  }
  return a;
}

std::vector<OptionSpec> blasst_own_options() {
  return {{"base", OptKind::String, "full",
           "selector the skipping runs inside: a method or a stack a+b (full, quest, "
           "quest+twilight, ...)"},
          OptionSpec{"lambda", OptKind::Float, "auto",
                     "fixed threshold lambda in [0, 1] (0 = exact)"}
              .range(0, 1),
          OptionSpec{"a", OptKind::Float, "auto",
                     cat("decode lambda = a / L (BLASST eq. 3); auto: a decode config's a, "
                         "else ", kBlasstDefaultA, " (SmolLM2, 50% target)")}
              .range(0, INFINITY),
          OptionSpec{"prefill_a", OptKind::Float, "auto",
                     cat("prefill lambda = prefill_a / L; auto: a prefill config's a, else ",
                         kBlasstDefaultPrefillA, " (SmolLM2, 50% target); a when a is given")}
              .range(0, INFINITY),
          OptionSpec{"config", OptKind::String, "",
                     "calibration JSON(s) of `spade calibrate blasst`, comma list; each sets "
                     "the a of its phase"}
              .names_file(),
          OptionSpec{"length", OptKind::String, "selected",
                     "L of a/L in decode: selected (keys the head attends) or context"}
              .one_of({"selected", "context"}),
          OptionSpec{"tile", OptKind::Int, "64",
                     "decode tile, selected keys per tile (BLASST: 64)"}
              .range(1, kMaxTile),
          OptionSpec{"prefill_tile", OptKind::Int, "128", "prefill key tile (BLASST: 128)"}
              .range(1, kMaxTile),
          OptionSpec{"q_block", OptKind::Int, "128",
                     "prefill query rows per block (one query head)"}
              .range(1, kMaxTile),
          OptionSpec{"order", OptKind::String, "sequential",
                     "tile order: sequential, reverse or sink_recent (BLASST 5.6 reordering)"}
              .one_of({"sequential", "reverse", "sink_recent"}),
          OptionSpec{"prefill", OptKind::Int, "0",
                     "skip tiles in prefill too (1) or prefill dense (0, the default: no "
                     "measured prefill gain on a real model, a measured quality cost; "
                     "docs/twilight_blasst.md)"}
              .range(0, 1),
          OptionSpec{"decode", OptKind::Int, "1", "skip tiles in decode (1) or decode exact (0)"}
              .range(0, 1)};
}

std::vector<OptionSpec> blasst_options() {
  return with_forwarded_options("blasst", blasst_own_options());
}

namespace {
std::vector<std::string> parse_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}
}  // namespace

std::unique_ptr<SparseMethod> make_blasst(const MethodOptions& o, const ModelConfig& cfg) {
  const std::string base_spec = o.str("base");
  for (const auto& s : split_stack(base_spec))
    SPADE_CHECK(s != "blasst", "blasst: blasst skips inside attention and must be the last "
                "stage, once (base=", base_spec, " has a blasst stage)");
  auto base_opts = route_to_base("blasst", blasst_own_options(), base_spec, given_options(o));
  BlasstMethod::Params prm;
  const bool has_l = !o.is_auto("lambda"), has_a = !o.is_auto("a"),
             has_pa = !o.is_auto("prefill_a"), has_c = !o.str("config").empty();
  SPADE_CHECK(!(has_l && (has_a || has_pa || has_c)),
              "blasst: lambda (fixed) excludes a, prefill_a and config");
  if (has_l) {
    prm.lambda = o.number("lambda");  // [0, 1]: MethodOptions
  } else {
    // decode: a > a decode config > default; prefill: prefill_a > a prefill config > a > default.
    double ca = -1, cpa = -1;
    for (const auto& path : parse_list(o.str("config"))) {
      std::string phase;
      const double v = read_blasst_config_a(path, &phase);
      (phase == "prefill" ? cpa : ca) = v;
    }
    prm.a = has_a ? o.number("a") : ca >= 0 ? ca : kBlasstDefaultA;
    prm.prefill_a = has_pa ? o.number("prefill_a") : cpa >= 0 ? cpa : has_a ? prm.a
                                                                         : kBlasstDefaultPrefillA;
    SPADE_CHECK(prm.a >= 0 && prm.prefill_a >= 0, "blasst: a and prefill_a must be >= 0");
  }
  prm.length_selected = o.str("length") == "selected";  // selected | context: MethodOptions
  prm.tile = o.integer("tile");
  prm.prefill_tile = o.integer("prefill_tile");
  prm.q_block = o.integer("q_block");
  prm.order = cpu::parse_tile_order(o.str("order"));
  prm.prefill = o.integer("prefill") != 0;
  prm.decode = o.integer("decode") != 0;
  auto base = make_stack(base_spec, base_opts, cfg);
  return std::make_unique<BlasstMethod>(std::move(base), prm);
}

}  // namespace spade::sparse
