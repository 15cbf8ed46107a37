// What the CLI front ends build on: generate()'s stop reasons and its per-prefill-chunk
// callback (progress lines, Ctrl-C in `spade chat`), and tools/progress.h's prefill progress
// line (threshold, ETA, rate limits, terminal and plain modes) on a fake clock.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "../tools/progress.h"
#include "engine/generator.h"
#include "scheduler_test_util.h"

namespace spade {
namespace {

using sched_test::Fixture;
using sched_test::make_prompt;

std::vector<int32_t> run(Fixture& f, PageTable& pt, const std::vector<int32_t>& prompt,
                         GenerateOptions go, GenerateStats* st,
                         const std::function<bool(int32_t)>& extra = nullptr) {
  std::vector<int32_t> out;
  *st = generate(f.model, pt, prompt, go, [&](int32_t t) {
    out.push_back(t);
    return extra ? extra(t) : true;
  });
  return out;
}

TEST(GenerateStop, Reasons) {
  Fixture f;
  const auto prompt = make_prompt(10, 1, f.cfg.vocab);
  GenerateOptions go;
  go.max_new_tokens = 12;
  GenerateStats st;
  {
    PageTable pt;
    const auto out = run(f, pt, prompt, go, &st);
    EXPECT_EQ(st.stop_reason, StopReason::kMaxTokens);
    EXPECT_EQ(out.size(), 12u);
    EXPECT_STREQ(stop_reason_name(st.stop_reason), "max-tokens");
    f.kv.release(pt);
    // The 5th token as a stop id: generation ends there, after emitting it.
    go.stop_ids = {out[4]};
    PageTable pt2;
    const auto out2 = run(f, pt2, prompt, go, &st);
    EXPECT_EQ(st.stop_reason, StopReason::kStopToken);
    EXPECT_TRUE(st.stopped_by_stop_id);
    EXPECT_EQ(out2.back(), out[4]);
    EXPECT_LE(out2.size(), 5u);
    EXPECT_STREQ(stop_reason_name(st.stop_reason), "eos");
    f.kv.release(pt2);
  }
  {
    go.stop_ids.clear();
    go.max_context = 15;  // 10 prompt tokens: 5 fed generated tokens, then the context is full
    PageTable pt;
    const auto out = run(f, pt, prompt, go, &st);
    EXPECT_EQ(st.stop_reason, StopReason::kContext);
    EXPECT_EQ(pt.length, 15);
    EXPECT_EQ(out.size(), 6u);  // the last one is emitted, not fed
    EXPECT_STREQ(stop_reason_name(st.stop_reason), "context");
    f.kv.release(pt);
  }
  {
    go.max_context = 0;
    PageTable pt;
    int n = 0;
    const auto out = run(f, pt, prompt, go, &st, [&](int32_t) { return ++n < 3; });
    EXPECT_EQ(st.stop_reason, StopReason::kInterrupted);
    EXPECT_EQ(out.size(), 3u);
    EXPECT_EQ(pt.length, 12);  // prompt + the tokens fed before the stop
    EXPECT_STREQ(stop_reason_name(st.stop_reason), "interrupted");
    f.kv.release(pt);
  }
}

TEST(GenerateStop, PrefillChunkCallbackReportsAndStops) {
  Fixture f;
  const auto prompt = make_prompt(40, 2, f.cfg.vocab);
  GenerateOptions go;
  go.max_new_tokens = 4;
  go.prefill_chunk = 16;
  std::vector<std::pair<int64_t, int64_t>> calls;
  go.on_prefill_chunk = [&](int64_t done, int64_t total) {
    calls.push_back({done, total});
    return true;
  };
  GenerateStats st;
  PageTable pt;
  const auto out = run(f, pt, prompt, go, &st);
  EXPECT_EQ(calls, (std::vector<std::pair<int64_t, int64_t>>{{16, 40}, {32, 40}, {40, 40}}));
  EXPECT_EQ(out.size(), 4u);
  f.kv.release(pt);
  // The same tokens as without the callback.
  GenerateOptions plain = go;
  plain.on_prefill_chunk = nullptr;
  PageTable pt2;
  EXPECT_EQ(run(f, pt2, prompt, plain, &st), out);
  f.kv.release(pt2);

  // Returning false stops the prefill after that chunk: no token, the fed chunks cached.
  calls.clear();
  go.on_prefill_chunk = [&](int64_t done, int64_t total) {
    calls.push_back({done, total});
    return done < 32;
  };
  PageTable pt3;
  bool called = false;
  run(f, pt3, prompt, go, &st, [&](int32_t) { return called = true; });
  EXPECT_FALSE(called);
  EXPECT_EQ(st.stop_reason, StopReason::kInterrupted);
  EXPECT_EQ(st.generated_tokens, 0);
  EXPECT_EQ(calls.size(), 2u);
  EXPECT_EQ(pt3.length, 32);
  f.kv.release(pt3);
  EXPECT_EQ(f.kv.used_pages(), 0);
}

// PrefillProgress writing to a temporary file on a fake clock.
struct ProgressRun {
  explicit ProgressRun(double after, bool tty)
      : file(std::tmpfile()), p(after, file, tty, [this] { return now; }) {}
  double now = 100;  // declared first: the progress reads it when constructed
  ~ProgressRun() { std::fclose(file); }
  std::string text() {
    std::fflush(file);
    std::rewind(file);
    std::string s;
    char buf[512];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, file)) > 0) s.append(buf, n);
    return s;
  }
  std::FILE* file;
  cli::PrefillProgress p;
};

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

TEST(PrefillProgress, NothingForAShortPrefill) {
  ProgressRun r(2.0, false);
  r.p.start();
  r.now += 0.5;
  r.p.update(500, 1000);
  r.now += 1.4;
  r.p.update(1000, 1000);
  EXPECT_EQ(r.text(), "");
  ProgressRun never(-1, false);
  never.p.start();
  never.now += 100;
  never.p.update(10, 1000);
  never.p.update(1000, 1000);
  EXPECT_EQ(never.text(), "");
}

TEST(PrefillProgress, PlainLinesEveryFiveSecondsWithEtaAndATotal) {
  ProgressRun r(2.0, false);
  r.p.start();
  r.now += 1;
  r.p.update(100, 1000);  // under the threshold: nothing
  r.now += 1.5;
  r.p.update(250, 1000);  // 2.5 s: 100 tok/s, 750 left: ETA 7.5 s
  r.now += 1;
  r.p.update(350, 1000);  // within 5 s of the last line: nothing
  r.now += 4.5;
  r.p.update(800, 1000);  // 8 s: 100 tok/s, ETA 2 s
  r.now += 2;
  r.p.update(1000, 1000);
  EXPECT_EQ(r.text(),
            "[spade] prefill 250/1000 tokens (25%), 100 tok/s, ETA 7.5 s\n"
            "[spade] prefill 800/1000 tokens (80%), 100 tok/s, ETA 2.0 s\n"
            "[spade] prefill done: 1000 tokens in 10.0 s (100 tok/s)\n");
  // The next prefill (chat's next turn) starts over.
  r.p.start();
  r.now += 0.1;
  r.p.update(10, 20);
  r.p.update(20, 20);
  EXPECT_EQ(count(r.text(), "\n"), 3u);
}

TEST(PrefillProgress, OneTerminalLineRewrittenAndErased) {
  ProgressRun r(0.0, true);
  r.p.start();
  for (int i = 1; i <= 21; ++i) {  // 21 chunks over 1.05 s: at most 4 updates a second
    r.now += 0.05;
    r.p.update(i * 10, 210);
  }
  const std::string s = r.text();
  EXPECT_EQ(s.find('\n'), std::string::npos) << s;
  EXPECT_EQ(s.rfind("\r\x1b[K"), s.size() - 4) << "erased at the end";
  const size_t lines = count(s, "\r[spade] prefill ");
  EXPECT_GE(lines, 3u);
  EXPECT_LE(lines, 5u);
  EXPECT_NE(s.find("\r[spade] prefill 10/210 tokens (4%), 200 tok/s, ETA 1.0 s\x1b[K"), std::string::npos)
      << s;
  EXPECT_EQ(s.find("done"), std::string::npos);
}

}  // namespace
}  // namespace spade
