// Task generators of src/eval/tasks.h. Each generator draws its content from the seed, then
// returns a Draft: a function from a filler amount to the user message; fit() picks the
// largest filler that keeps the rendered prompt within the target length.
#include "eval/tasks.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "core/error.h"
#include "eval/rng.h"
#include "tokenizer/chat_template.h"

namespace spade::eval {
namespace {

const std::vector<std::string> kAdjectives = {
    "amber",  "bitter",  "brave",  "bright",  "calm",    "clever", "cold",   "crimson",
    "curious", "dark",   "eager",  "early",   "fancy",   "gentle", "golden", "grand",
    "happy",  "hidden",  "hollow", "humble",  "icy",     "jolly",  "kind",   "lively",
    "lucky",  "mellow",  "misty",  "noble",   "odd",     "pale",   "proud",  "quiet",
    "rapid",  "rusty",   "silent", "silver",  "smooth",  "sunny",  "swift",  "tender",
    "tiny",   "velvet",  "wild",   "windy",   "wise",    "young"};
const std::vector<std::string> kNouns = {
    "anchor", "badger",  "banner", "beacon",  "bridge",  "candle", "canyon", "castle",
    "cedar",  "comet",   "copper", "crystal", "dolphin", "dragon", "falcon", "forest",
    "garden", "glacier", "harbor", "hammer",  "island",  "jaguar", "lantern", "meadow",
    "mirror", "monkey",  "needle", "orchid",  "otter",   "panther", "pepper", "pillow",
    "planet", "quartz",  "rabbit", "river",   "rocket",  "saddle", "salmon", "shadow",
    "spider", "summit",  "thunder", "tiger",  "tunnel",  "valley", "violin", "walrus"};
const std::vector<std::string> kValueWords = {
    "apricot", "blizzard", "cathedral", "daffodil", "eclipse",  "fountain", "gondola",
    "horizon", "igloo",    "juniper",   "kettle",   "labyrinth", "magnolia", "nebula",
    "obsidian", "parachute", "quiver",  "raspberry", "sapphire", "telescope", "umbrella",
    "volcano", "waterfall", "xylophone", "yacht",   "zeppelin",  "avalanche", "biscuit",
    "carousel", "dynamo",  "emerald",   "flamingo", "gargoyle",  "harmonica", "iceberg",
    "jasmine", "kaleidoscope", "lighthouse", "mosaic", "nutmeg",  "origami",   "pendulum"};
const std::vector<std::string> kCities = {
    "Lyon",  "Porto", "Oslo",  "Kyoto", "Quito", "Perth",  "Cairo",  "Lima",  "Riga",
    "Turin", "Dakar", "Hanoi", "Accra", "Bern",  "Dublin", "Malmo",  "Split", "Tartu"};

std::string key_phrase(Rng& r, const char* sep) {
  return r.pick(kAdjectives) + sep + r.pick(kNouns);
}
// `n` distinct key phrases.
std::vector<std::string> distinct_keys(Rng& r, size_t n, const char* sep) {
  std::set<std::string> seen;
  std::vector<std::string> out;
  for (size_t tries = 0; out.size() < n; ++tries) {
    std::string k = key_phrase(r, sep);
    if (tries > 50 * n) k += std::to_string(out.size());  // more keys than combinations
    if (seen.insert(k).second) out.push_back(k);
  }
  return out;
}
std::string number7(Rng& r) { return std::to_string(r.range(1000000, 9999999)); }
std::string uuid(Rng& r) {
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (int g : {8, 4, 4, 4, 12}) {
    if (!s.empty()) s += '-';
    for (int i = 0; i < g; ++i) s += hex[r.below(16)];
  }
  return s;
}
std::string upper_name(Rng& r, int len) {
  std::string s;
  for (int i = 0; i < len; ++i) s += char('A' + r.below(26));
  return s;
}

struct Draft {
  std::function<std::string(int64_t filler)> user;
  std::string prefix;
  std::vector<std::string> answers;
  ScoreRule rule = ScoreRule::All;
  int max_new = 32;
};

// Haystack lines [start, start + n) (cyclic) with `inserts` placed before the line at
// round(depth * n); inserts at equal positions keep their order.
std::string hay_with(const std::vector<std::string>& hay, size_t start, int64_t n,
                     const std::vector<std::pair<double, std::string>>& inserts) {
  std::vector<std::pair<int64_t, size_t>> at;  // (line, insert index)
  for (size_t i = 0; i < inserts.size(); ++i)
    at.push_back({int64_t(std::llround(inserts[i].first * double(n))), i});
  std::stable_sort(at.begin(), at.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string out;
  size_t k = 0;
  for (int64_t i = 0; i <= n; ++i) {
    while (k < at.size() && at[k].first <= i) out += inserts[at[k++].second].second + "\n";
    if (i < n) out += hay[(start + size_t(i)) % hay.size()] + "\n";
  }
  return out;
}

Draft niah(Rng& r, const std::vector<std::string>& hay, const std::string& kind, int n_keys,
           int n_values, int n_queries) {
  SPADE_CHECK(!hay.empty(), "the needle tasks need a haystack (--haystack-file)");
  const std::string type = kind == "number" ? "numbers" : kind == "word" ? "words" : "uuids";
  const std::vector<std::string> keys = distinct_keys(r, size_t(n_keys), "-");
  auto value = [&]() { return kind == "number" ? number7(r) : kind == "word" ? r.pick(kValueWords) : uuid(r); };
  std::vector<std::pair<double, std::string>> needles;
  std::vector<std::vector<std::string>> values(static_cast<size_t>(n_keys));
  std::set<std::string> used;
  for (int k = 0; k < n_keys; ++k)
    for (int v = 0; v < (k == 0 ? n_values : 1); ++v) {
      std::string val;
      do val = value();
      while (!used.insert(val).second);
      values[size_t(k)].push_back(val);
      needles.push_back({r.unit(), "One of the special magic " + type + " for " + keys[size_t(k)] +
                                       " is: " + val + "."});
    }
  const size_t start = size_t(r.below(hay.size()));
  // Queried keys: the first n_queries (key 0 carries the n_values values).
  std::vector<std::string> q(keys.begin(), keys.begin() + n_queries), answers;
  for (int k = 0; k < n_queries; ++k)
    for (const auto& v : values[size_t(k)]) answers.push_back(v);
  std::string query = q[0];
  if (q.size() > 1) {
    query.clear();
    for (size_t i = 0; i < q.size(); ++i)
      query += (i ? (i + 1 == q.size() ? ", and " : ", ") : "") + q[i];
  }
  const bool many = answers.size() > 1;
  const std::string what = "special magic " + (many ? type : type.substr(0, type.size() - 1));
  const std::string head = "Some special magic " + type +
                           " are hidden within the following text. Make sure to memorize it. I "
                           "will quiz you about the " + type + " afterwards.\n";
  const std::string question = many ? "What are all the " + what + " for " + query +
                                          " mentioned in the provided text?"
                                    : "What is the " + what + " for " + query +
                                          " mentioned in the provided text?";
  Draft d;
  d.user = [=, &hay](int64_t n) { return head + hay_with(hay, start, n, needles) + question; };
  d.prefix = "The " + what + " for " + query + " mentioned in the provided text " +
             (many ? "are" : "is");
  d.answers = answers;
  d.max_new = kind == "uuid" ? 40 : many ? int(12 * answers.size() + 8) : 16;
  return d;
}

Draft variable_tracking(Rng& r, const std::vector<std::string>& hay) {
  SPADE_CHECK(!hay.empty(), "variable tracking needs a haystack (--haystack-file)");
  const int hops = 4;
  std::vector<std::string> names;
  std::set<std::string> seen;
  while (names.size() < size_t(hops + 1)) {
    std::string n = upper_name(r, 5);
    if (seen.insert(n).second) names.push_back(n);
  }
  const std::string value = std::to_string(r.range(10000, 99999));
  std::vector<double> depths;
  for (int i = 0; i <= hops; ++i) depths.push_back(r.unit());
  std::sort(depths.begin(), depths.end());
  std::vector<std::pair<double, std::string>> lines;
  lines.push_back({depths[0], "VAR " + names[0] + " = " + value});
  for (int i = 1; i <= hops; ++i)
    lines.push_back({depths[size_t(i)], "VAR " + names[size_t(i)] + " = VAR " + names[size_t(i - 1)]});
  const size_t start = size_t(r.below(hay.size()));
  Draft d;
  d.user = [=, &hay](int64_t n) {
    return "Memorize and track the chain(s) of variable assignment hidden in the following "
           "text.\n\n" + hay_with(hay, start, n, lines) +
           "\nQuestion: Find all variables that are assigned the value " + value +
           " in the text above.";
  };
  d.prefix = "Answer: According to the chain(s) of variable assignment in the text above, " +
             std::to_string(hops + 1) + " variables are assigned the value " + value +
             ", they are:";
  d.answers = names;
  d.max_new = 40;
  return d;
}

Draft frequent_words(Rng& r) {
  // RULER's fwe: coded words with Zipf(alpha = 2) frequencies; the answer is the top three.
  const int V = 60;
  const double alpha = 2.0;
  std::vector<std::string> vocab;
  std::set<std::string> seen;
  while (vocab.size() < size_t(V)) {
    std::string w;
    const int len = int(r.range(3, 7));
    for (int i = 0; i < len; ++i) w += char('a' + r.below(26));
    if (seen.insert(w).second) vocab.push_back(w);
  }
  double H = 0;
  for (int k = 1; k <= V; ++k) H += std::pow(double(k), -alpha);
  const uint64_t order_seed = r.next();
  Draft d;
  d.user = [=](int64_t n) {
    // n words in all: rank k appears max(1, round(n * k^-alpha / H)) times (ranks 1-3 are
    // kept distinct and above rank 4 by the Zipf counts once n >= 40).
    std::vector<const std::string*> words;
    for (int k = 1; k <= V; ++k) {
      const int64_t c = std::max<int64_t>(1, std::llround(double(n) * std::pow(double(k), -alpha) / H));
      for (int64_t i = 0; i < c; ++i) words.push_back(&vocab[size_t(k - 1)]);
    }
    Rng o(order_seed);
    o.shuffle(words);
    std::string text;
    for (size_t i = 0; i < words.size(); ++i) text += (i ? " .... " : "") + *words[i];
    return "Read the following coded text and track the frequency of each coded word. Find the "
           "three most frequently appeared coded words. " + text +
           "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are "
           "the three most frequently appeared words in the above coded text?";
  };
  d.prefix = "Answer: According to the coded text above, the three most frequently appeared words are:";
  d.answers = {vocab[0], vocab[1], vocab[2]};
  d.max_new = 32;
  return d;
}

// Records for the structured tasks: distinct names, one queried at a random depth.
struct Records {
  std::vector<std::string> names;
  std::vector<std::string> cities;
  std::vector<int64_t> codes;
  size_t query = 0;
};
Records records(Rng& r, size_t n, const char* sep) {
  Records rec;
  rec.names = distinct_keys(r, n, sep);
  std::set<int64_t> used;
  for (size_t i = 0; i < n; ++i) {
    int64_t c;
    do c = r.range(100000, 999999);
    while (!used.insert(c).second);
    rec.codes.push_back(c);
    rec.cities.push_back(r.pick(kCities));
  }
  return rec;
}

Draft json_lookup(Rng& r) {
  const size_t max_records = 2000;
  Records rec = records(r, max_records, "-");
  const double depth = r.unit();
  Draft d;
  // The queried record is record 0, placed at `depth` among the n records shown.
  d.user = [=](int64_t n) {
    n = std::max<int64_t>(1, std::min<int64_t>(n, int64_t(max_records)));
    const int64_t at = std::min<int64_t>(n - 1, std::llround(depth * double(n - 1)));
    std::string s = "Here is a JSON array of records.\n[\n";
    for (int64_t i = 0, other = 1; i < n; ++i) {
      const size_t k = i == at ? 0 : size_t(other++);
      s += "  {\"name\": \"" + rec.names[k] + "\", \"city\": \"" + rec.cities[k] +
           "\", \"code\": " + std::to_string(rec.codes[k]) + "}" + (i + 1 < n ? "," : "") + "\n";
    }
    return s + "]\nWhat is the code of the record whose name is \"" + rec.names[0] + "\"?";
  };
  d.prefix = "The code of the record whose name is \"" + rec.names[0] + "\" is";
  d.answers = {std::to_string(rec.codes[0])};
  d.max_new = 12;
  return d;
}

Draft code_lookup(Rng& r) {
  const size_t max_records = 2000;
  Records rec = records(r, max_records, "_");
  const double depth = r.unit();
  Draft d;
  d.user = [=](int64_t n) {
    n = std::max<int64_t>(1, std::min<int64_t>(n, int64_t(max_records)));
    const int64_t at = std::min<int64_t>(n - 1, std::llround(depth * double(n - 1)));
    std::string s = "Here is a C++ source file.\n```cpp\n#include <cstdint>\n\nnamespace config {\n";
    for (int64_t i = 0, other = 1; i < n; ++i) {
      const size_t k = i == at ? 0 : size_t(other++);
      if (i % 8 == 0) s += "\n// " + rec.cities[k] + " services\n";
      s += "constexpr int32_t " + rec.names[k] + "_port = " + std::to_string(rec.codes[k]) + ";\n";
    }
    return s + "\n}  // namespace config\n```\nWhat is the value of " + rec.names[0] +
           "_port in the code above?";
  };
  d.prefix = "The value of " + rec.names[0] + "_port is";
  d.answers = {std::to_string(rec.codes[0])};
  d.max_new = 12;
  return d;
}

Draft draft(const std::string& task, Rng& r, const std::vector<std::string>& hay) {
  if (task == "niah_single_number") return niah(r, hay, "number", 1, 1, 1);
  if (task == "niah_single_word") return niah(r, hay, "word", 1, 1, 1);
  if (task == "niah_single_uuid") return niah(r, hay, "uuid", 1, 1, 1);
  if (task == "niah_multikey") return niah(r, hay, "number", 4, 1, 1);
  if (task == "niah_multivalue") return niah(r, hay, "number", 1, 4, 1);
  if (task == "niah_multiquery") return niah(r, hay, "number", 4, 1, 4);
  if (task == "variable_tracking") return variable_tracking(r, hay);
  if (task == "frequent_words") return frequent_words(r);
  if (task == "json_lookup") return json_lookup(r);
  if (task == "code_lookup") return code_lookup(r);
  parse_task_list(task);  // throws listing the valid names
  fail("unknown task '", task, "'");
}

}  // namespace

const std::vector<TaskInfo>& all_tasks() {
  static const std::vector<TaskInfo> t = {
      {"niah_single_number", "one needle, 7-digit number value", true},
      {"niah_single_word", "one needle, word value", true},
      {"niah_single_uuid", "one needle, UUID value", true},
      {"niah_multikey", "4 needles with different keys, one asked", true},
      {"niah_multivalue", "4 values for one key, all asked", true},
      {"niah_multiquery", "4 needles with different keys, all asked", true},
      {"variable_tracking", "a 4-hop chain of variable assignments, all names asked", true},
      {"frequent_words", "coded words with Zipf frequencies, top 3 asked", false},
      {"json_lookup", "code of a named record in a long JSON array", false},
      {"code_lookup", "value of a named constant in a long C++ listing", false},
  };
  return t;
}

std::vector<std::string> parse_task_list(const std::string& list) {
  std::vector<std::string> out;
  if (list == "all") {
    for (const auto& t : all_tasks()) out.push_back(t.name);
    return out;
  }
  size_t b = 0;
  while (b <= list.size()) {
    size_t e = list.find(',', b);
    if (e == std::string::npos) e = list.size();
    const std::string name = list.substr(b, e - b);
    if (!name.empty()) {
      bool ok = false;
      for (const auto& t : all_tasks()) ok |= t.name == name;
      if (!ok) {
        std::string names;
        for (const auto& t : all_tasks()) names += (names.empty() ? "" : ", ") + t.name;
        fail("unknown task '", name, "' (tasks: ", names, ", or all)");
      }
      out.push_back(name);
    }
    b = e + 1;
  }
  SPADE_CHECK(!out.empty(), "no task given");
  return out;
}

TaskSample make_task(const std::string& task, int64_t length, uint64_t seed,
                     const std::vector<std::string>& haystack, const PromptTokens& count) {
  Rng r(seed);
  Draft d = draft(task, r, haystack);
  auto fits = [&](int64_t n) { return count(d.user(n), d.prefix) <= length; };
  SPADE_CHECK(fits(0), "task ", task, " does not fit in ", length, " tokens even without filler");
  // Exponential then binary search for the largest filler that fits.
  int64_t lo = 0, hi = 16;
  while (fits(hi)) {
    lo = hi;
    hi *= 2;
    SPADE_CHECK(hi < (int64_t(1) << 24), "task ", task, ": filler does not grow the prompt");
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  TaskSample s;
  s.task = task;
  s.length = length;
  s.seed = seed;
  s.user = d.user(lo);
  s.answer_prefix = d.prefix;
  s.answers = d.answers;
  s.rule = d.rule;
  s.max_new_tokens = d.max_new;
  s.filler = lo;
  return s;
}

std::string render_prompt(const ChatTemplate& tmpl, const std::string& user,
                          const std::string& answer_prefix) {
  return tmpl.render({{"user", user}}, true) + answer_prefix;
}

}  // namespace spade::eval
