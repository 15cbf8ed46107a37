// markdown_report of src/eval/report.h.
#include "eval/report.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <vector>

namespace spade::eval {
namespace {

using json = nlohmann::json;

std::string fmt(double v, int prec) {
  if (std::isnan(v)) return "-";
  char b[64];
  std::snprintf(b, sizeof b, "%.*f", prec, v);
  return b;
}

// Distinct values of `field` in first-seen order.
std::vector<std::string> order_of(const json& rs, const std::string& field) {
  std::vector<std::string> out;
  for (const auto& r : rs) {
    const std::string v = r.at(field).is_string() ? r.at(field).get<std::string>() : r.at(field).dump();
    bool seen = false;
    for (const auto& o : out) seen |= o == v;
    if (!seen) out.push_back(v);
  }
  return out;
}

std::string str_of(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

struct Mean {
  double sum = 0;
  int n = 0;
  double get() const { return n ? sum / n : NAN; }
};


// Table of mean(value(r)) over records with filter(r), rows by `row`, columns by `col`,
// plus an "all" column.
std::string table(const json& rs, const std::string& row, const std::string& col,
                  const std::function<double(const json&)>& value,
                  const std::function<bool(const json&)>& filter, int prec,
                  const std::string& corner,
                  const std::function<double(double)>& post = nullptr) {
  std::vector<json> sel;
  for (const auto& r : rs)
    if (!filter || filter(r)) sel.push_back(r);
  if (sel.empty()) return "";
  const json js = sel;
  const auto rows = order_of(js, row);
  auto cols = order_of(js, col);
  if (col == "length")  // numeric order, whatever order the (resumed) runs met them in
    std::sort(cols.begin(), cols.end(),
              [](const std::string& a, const std::string& b) { return std::stoll(a) < std::stoll(b); });
  std::map<std::pair<std::string, std::string>, Mean> m;
  std::map<std::string, Mean> all;
  auto pp = [&](double v) { return post ? post(v) : v; };
  for (const auto& r : sel) {
    const double v = value(r);
    if (std::isnan(v)) continue;
    auto& c = m[{str_of(r.at(row)), str_of(r.at(col))}];
    c.sum += v, ++c.n;
    auto& a = all[str_of(r.at(row))];
    a.sum += v, ++a.n;
  }
  std::string s = "| " + corner + " |";
  for (const auto& c : cols) s += " " + c + " |";
  if (cols.size() > 1) s += " all |";
  s += "\n|---|";
  for (size_t i = 0; i < cols.size() + (cols.size() > 1); ++i) s += "---:|";
  s += "\n";
  for (const auto& rw : rows) {
    s += "| " + rw + " |";
    for (const auto& c : cols) {
      auto it = m.find({rw, c});
      s += " " + (it == m.end() ? std::string("-") : fmt(pp(it->second.get()), prec)) + " |";
    }
    if (cols.size() > 1) s += " " + fmt(pp(all[rw].get()), prec) + " |";
    s += "\n";
  }
  return s + "\n";
}

double num(const json& r, const char* k) {
  return r.contains(k) && r.at(k).is_number() ? r.at(k).get<double>() : NAN;
}

// The sparse layers' density: Twilight's kept fraction where it prunes (its base budget,
// max(8192, L/4) in the sweep, says nothing of what it attends).
const char* const kSparseDensityTitle =
    "Density of the sparse layers (Twilight: the fraction its top-p keeps where it prunes)";

// "## title" and the method x length table of field `key` (empty when no record has it).
std::string field_section(const json& rs, const std::string& title, const char* key, int prec,
                          const std::string& corner) {
  const std::string t = table(rs, "method", "length", [key](const json& r) { return num(r, key); },
                              [key](const json& r) { return r.contains(key); }, prec, corner);
  return t.empty() ? "" : "## " + title + "\n\n" + t;
}

// "1-2, 4" of 0-based command indices.
std::string ranges(const std::vector<size_t>& ix) {
  std::string s;
  for (size_t a = 0; a < ix.size();) {
    size_t b = a;
    while (b + 1 < ix.size() && ix[b + 1] == ix[b] + 1) ++b;
    s += (s.empty() ? "" : ", ") + std::to_string(ix[a] + 1) +
         (b > a ? "-" + std::to_string(ix[b] + 1) : "");
    a = b + 1;
  }
  return s;
}

// Samples per cell (method x task x length) as the records hold them, whatever each
// command's --samples said: "3", or per method "3 (full, quest:budget=128); 1-2 (oracle-topp)".
// Empty when the records carry no "sample".
std::string samples_per_cell(const json& rs) {
  std::map<std::string, std::map<std::string, std::set<std::string>>> cells;  // method -> cell -> samples
  for (const auto& r : rs) {
    if (!r.contains("sample") || !r.contains("method")) continue;
    const std::string cell = (r.contains("task") ? str_of(r.at("task")) : "") + "|" +
                             (r.contains("length") ? str_of(r.at("length")) : "");
    cells[str_of(r.at("method"))][cell].insert(str_of(r.at("sample")));
  }
  if (cells.empty()) return "";
  std::vector<std::pair<std::string, std::string>> groups;  // count or range -> methods
  for (const auto& m : order_of(rs, "method")) {
    if (!cells.count(m)) continue;
    size_t lo = SIZE_MAX, hi = 0;
    for (const auto& [cell, ks] : cells[m]) lo = std::min(lo, ks.size()), hi = std::max(hi, ks.size());
    const std::string n = std::to_string(lo) + (hi > lo ? "-" + std::to_string(hi) : "");
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == n; });
    if (g == groups.end()) groups.push_back({n, m});
    else g->second += ", " + m;
  }
  if (groups.size() == 1) return groups[0].first;
  std::string s;
  for (const auto& [n, ms] : groups) s += (s.empty() ? "" : "; ") + n + " (" + ms + ")";
  return s;
}

// The meta of each command ("runs", results.h), null where not recorded.
std::vector<json> run_metas(const json& doc) {
  const size_t n = doc.contains("commands") ? doc.at("commands").size() : 0;
  std::vector<json> out(std::max<size_t>(n, 1));
  if (doc.contains("runs") && doc.at("runs").size() == n) {
    for (size_t i = 0; i < n; ++i) out[i] = doc.at("runs")[i].value("meta", json());
  } else {
    out[0] = doc.at("meta");  // a file before "runs": its meta is the first command's
  }
  return out;
}

std::string header(const json& doc, const std::string& title) {
  std::string s = "# " + title + "\n\n";
  const json& rs = doc.at("results");
  const std::vector<json> metas = run_metas(doc);
  std::vector<size_t> known, unknown;
  for (size_t i = 0; i < metas.size(); ++i)
    (metas[i].is_object() ? known : unknown).push_back(i);
  const std::string samples = samples_per_cell(rs);
  const json& m = doc.at("meta");
  for (auto it = m.begin(); it != m.end(); ++it) {
    if (it.key() == "samples" && !samples.empty()) {  // what the records hold, not --samples
      s += "- samples per cell: " + samples + "\n";
      continue;
    }
    // Each value with the commands that had it (a key a command lacks reads "-").
    std::vector<std::pair<std::string, std::vector<size_t>>> vals;
    for (size_t i = 0; i < metas.size(); ++i) {
      if (!metas[i].is_object()) continue;
      const std::string v = metas[i].contains(it.key()) ? str_of(metas[i].at(it.key())) : "-";
      auto g = std::find_if(vals.begin(), vals.end(), [&](const auto& x) { return x.first == v; });
      if (g == vals.end()) vals.push_back({v, {i}});
      else g->second.push_back(i);
    }
    if (vals.size() <= 1) {
      s += "- " + it.key() + ": " + (vals.empty() ? str_of(it.value()) : vals[0].first) + "\n";
      continue;
    }
    s += "- " + it.key() + ":\n";
    for (const auto& [v, ix] : vals)
      s += "  - command" + std::string(ix.size() > 1 ? "s " : " ") + ranges(ix) + ": " + v + "\n";
  }
  if (!samples.empty() && !m.contains("samples")) s += "- samples per cell: " + samples + "\n";
  s += "- records: " + std::to_string(rs.size()) + "\n";
  if (!unknown.empty() && metas.size() > 1)
    s += "- settings of command" + std::string(unknown.size() > 1 ? "s " : " ") + ranges(unknown) +
         ": not recorded (the file predates per-command settings); the values above are "
         "from command" + (known.size() > 1 ? "s " : " ") + ranges(known) + "\n";
  if (doc.contains("notes"))  // free-text remarks added to the JSON by hand
    for (const auto& n : doc.at("notes")) s += "- note: " + str_of(n) + "\n";
  if (doc.contains("commands") && !doc.at("commands").empty()) {
    const json& cmds = doc.at("commands");
    const bool counted = doc.contains("runs") && doc.at("runs").size() == cmds.size();
    s += "\nCommand" + std::string(cmds.size() > 1 ? "s (the run was resumed)" : "") + ":\n\n```\n";
    for (size_t i = 0; i < cmds.size(); ++i) {
      if (cmds.size() > 1) {
        const json n = counted ? doc.at("runs")[i].value("records", json()) : json();
        s += "# command " + std::to_string(i + 1) +
             (n.is_number() ? ": " + n.dump() + " records" : "") + "\n";
      }
      s += cmds[i].get<std::string>() + "\n";
    }
    s += "```\n";
  }
  return s + "\n";
}

// Which backend produced each method's records, when any ran on the GPU (`--device cuda`
// runs the methods without a GPU path on the CPU; records before the field existed are CPU).
std::string backend_section(const json& rs) {
  std::map<std::string, std::set<std::string>> of;
  bool gpu = false;
  for (const auto& r : rs) {
    const std::string b = r.value("backend", "cpu");
    of[str_of(r.at("method"))].insert(b);
    gpu |= b == "cuda";
  }
  if (!gpu) return "";
  std::string s = "## Backend per method\n\nThe GPU (cuda) runs each method on a CudaModel "
                  "(bf16 weights and KV cache); the CPU runs fp32. GPU records carry no per-step "
                  "session counters: their recall and sparse-layer density cells are '-'; their "
                  "density is the request's attended / dense decode rows (BLASST's skipped tiles "
                  "not attended).\n\n"
                  "| method | backend |\n|---|---|\n";
  for (const auto& m : order_of(rs, "method")) {
    std::string b;
    for (const auto& x : of[m]) b += (b.empty() ? "" : " + ") + x;
    s += "| " + m + " | " + b + " |\n";
  }
  return s + "\n";
}

std::string tasks_report(const json& doc) {
  const json& rs = doc.at("results");
  std::string s = header(doc, "spade eval tasks");
  s += backend_section(rs);
  auto score = [](const json& r) { return num(r, "score"); };
  s += "## Mean score (all tasks) per method and prompt length\n\n";
  s += "Score: fraction of the expected answers found in the output (exact match, "
       "case-insensitive), averaged over tasks and samples.\n\n";
  s += table(rs, "method", "length", score, nullptr, 3, "method \\ length");
  for (const auto& L : order_of(rs, "length")) {
    s += "## Score per task, length " + L + "\n\n";
    s += table(rs, "task", "method", score, [&](const json& r) { return str_of(r.at("length")) == L; }, 2,
               "task \\ method");
  }
  s += "## Density (attended / context, mean over layers, KV heads and steps)\n\n";
  s += table(rs, "method", "length", [](const json& r) { return num(r, "density"); }, nullptr, 3,
             "method \\ length");
  s += field_section(rs, kSparseDensityTitle, "sparse_density", 3, "method \\ length");
  // Tasks full attention does not solve.
  std::map<std::pair<std::string, std::string>, Mean> full;
  for (const auto& r : rs)
    if (r.at("method") == "full") {
      auto& m = full[{r.at("task").get<std::string>(), str_of(r.at("length"))}];
      m.sum += num(r, "score"), ++m.n;
    }
  std::string bad;
  for (const auto& [k, m] : full)
    if (m.get() < 0.5) bad += "| " + k.first + " | " + k.second + " | " + fmt(m.get(), 2) + " |\n";
  s += "## Tasks full attention does not solve (mean score < 0.5)\n\n";
  s += bad.empty() ? "None.\n\n"
                   : "A sparse method cannot be judged on these: the model fails them with exact "
                     "attention.\n\n| task | length | full score |\n|---|---:|---:|\n" + bad + "\n";
  return s;
}

std::string ppl_report(const json& doc) {
  const json& rs = doc.at("results");
  std::string s = header(doc, "spade eval ppl");
  s += backend_section(rs);
  s += "## Perplexity of the scored tokens (decode mode) per method and prefix length\n\n"
       "exp(mean NLL) over the samples' scored tokens. The prefix is prefilled densely on the CPU "
       "(one prefill shared by the methods) and by each method itself on the GPU (BLASST with "
       "prefill=1 skips tiles there).\n\n";
  // The mean NLL over samples, then exp.
  s += table(rs, "method", "length", [](const json& r) { return num(r, "nll_mean"); }, nullptr, 3,
             "method \\ prefix", [](double v) { return std::exp(v); });
  s += "## Density\n\n";
  s += table(rs, "method", "length", [](const json& r) { return num(r, "density"); }, nullptr, 3,
             "method \\ prefix");
  s += field_section(rs, kSparseDensityTitle, "sparse_density", 3, "method \\ prefix");
  return s;
}

std::string agree_report(const json& doc) {
  const json& rs = doc.at("results");
  std::string s = header(doc, "spade eval agree");
  s += backend_section(rs);
  // --ref-kv-dtype T: each method's reference is the same method over a KV cache of type T.
  const json* meta = doc.contains("meta") ? &doc.at("meta") : nullptr;
  std::string ref_kv;
  if (meta && meta->contains("reference_kv_dtype") && meta->at("reference_kv_dtype").is_string()) {
    ref_kv = meta->at("reference_kv_dtype").get<std::string>();
  } else if (meta && meta->contains("reference") && meta->at("reference").is_string()) {
    // Files written before the field: "each method over a T KV cache".
    const std::string r = meta->at("reference").get<std::string>(), pre = "each method over a ";
    if (r.rfind(pre, 0) == 0 && r.size() > pre.size() + 9 && r.compare(r.size() - 9, 9, " KV cache") == 0)
      ref_kv = r.substr(pre.size(), r.size() - pre.size() - 9);
  }
  const std::string ref = ref_kv.empty() ? "full attention" : "the same method over a " + ref_kv + " KV cache";
  const std::string ref_short = ref_kv.empty() ? "full" : "method@" + ref_kv;
  s += "Greedy generation with each method vs " + ref + " from the same prompt (task prompts). "
       "Tokens until the first divergence; KL(" + ref_short + " || method) per step along the "
       "reference's tokens (teacher forced); top-1 agreement on those steps; output identical "
       "to the reference's; the method's task score.\n\n";
  const char* corner = "method \\ length";
  s += field_section(rs, "Tokens until first divergence", "first_divergence", 1, corner);
  s += field_section(rs, "Mean per-step KL(" + ref_short + " || method), nats", "kl_mean", 4, corner);
  s += field_section(rs, "Top-1 agreement (teacher forced)", "top1_agreement", 3, corner);
  s += field_section(rs, ref_kv.empty() ? "Output identical to full attention's"
                                        : "Output identical to the " + ref_kv + " reference's",
                     "same_output", 2, corner);
  s += field_section(rs, "Task score", "score", 3, corner);
  s += field_section(rs, "Density (attended / context, mean over layers, KV heads and steps)",
                     "density", 3, corner);
  s += field_section(rs, kSparseDensityTitle, "sparse_density", 3, corner);
  return s;
}

std::string longgen_report(const json& doc) {
  const json& rs = doc.at("results");
  std::string s = header(doc, "spade eval longgen");
  s += backend_section(rs);
  s += "A short prompt (an excerpt of the text), then the given number of generated tokens "
       "(EOS ignored); full attention's greedy tokens are the reference (with --follow-text, "
       "records with \"reference\": \"text\": the text's own continuation, full attention "
       "teacher forced along it). Free running: tokens "
       "until the method's text first diverges. Teacher forced along the reference: mean "
       "per-step KL(full || method) over full's top 1024 tokens plus one tail bucket (a lower "
       "bound of the full KL; per-window means in the JSON), top-1 agreement, perplexity of the "
       "reference tokens (and full attention's own), density; recall when "
       "measured (CPU).\n\n";
  const char* rows = "method \\ generated tokens";
  s += field_section(rs, "Tokens until first divergence", "first_divergence", 1, rows);
  s += field_section(rs, "Mean per-step KL(full || method), nats", "kl_mean", 4, rows);
  s += field_section(rs, "Top-1 agreement (teacher forced)", "top1_agreement", 3, rows);
  s += field_section(rs, "Perplexity of the reference tokens", "ppl", 3, rows);
  s += field_section(rs, "Density", "density", 3, rows);
  s += field_section(rs, kSparseDensityTitle, "sparse_density", 3, rows);
  s += field_section(rs, "Full attention's perplexity of its own tokens", "ppl_full", 3, rows);
  s += field_section(rs, "Recall (sparse layers)", "sparse_recall", 4, rows);
  return s;
}

std::string recall_report(const json& doc) {
  const json& rs = doc.at("results");
  std::string s = header(doc, "spade eval recall");
  s += "Attention recall (true full-attention weight on the attended tokens, mean over layers, "
       "query heads and decode steps; dense layers count 1) and density during teacher-forced "
       "decoding of real text after a dense prefix. Per-layer and per-head values are in the "
       "JSON.\n\n";
  s += "## Recall (all layers)\n\n";
  s += table(rs, "method", "length", [](const json& r) { return num(r, "recall"); }, nullptr, 4,
             "method \\ prefix");
  s += "## Recall (sparse layers only)\n\n";
  s += table(rs, "method", "length", [](const json& r) { return num(r, "sparse_recall"); }, nullptr, 4,
             "method \\ prefix");
  s += "## Minimum recall (any layer, head, step)\n\n";
  s += table(rs, "method", "length", [](const json& r) { return num(r, "min_recall"); }, nullptr, 4,
             "method \\ prefix");
  s += "## Density\n\n";
  s += table(rs, "method", "length", [](const json& r) { return num(r, "density"); }, nullptr, 4,
             "method \\ prefix");
  return s;
}

}  // namespace

std::string markdown_report(const json& doc) {
  const std::string kind = doc.value("kind", "");
  if (kind == "tasks") return tasks_report(doc);
  if (kind == "ppl") return ppl_report(doc);
  if (kind == "agree") return agree_report(doc);
  if (kind == "recall") return recall_report(doc);
  if (kind == "longgen") return longgen_report(doc);
  return "# spade eval\n\nunknown kind '" + kind + "'\n";
}

}  // namespace spade::eval
