// A model path that is not a regular file -- a FIFO, a directory where a file is expected, a
// device such as /dev/zero -- is a clear error in every loader entry (GGUF, safetensors
// directory and its shards / index, config.json, generation_config.json, tokenizer files,
// sparse config, head roles, BLASST config), never a read that blocks on the FIFO or one
// that never ends on the device.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "gguf_test_writer.h"
#include "model/loader.h"
#include "model/tensor_source.h"
#include "sparse/head_roles.h"
#include "sparse/methods/blasst.h"
#include "sparse/options.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace spade {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

const std::string kStories = test::source_dir() + "/tests/fixtures/models/stories260k-hf";

// Runs `fn` on a thread of its own and returns the message of the spade::Error it throws.
// The answer must come within `limit`: a loader that blocks on the FIFO instead is failed,
// and then unblocked (the FIFO's write end opened and closed: the reader sees end-of-file)
// so that the test binary goes on.
struct Outcome {
  bool finished = false;
  bool threw = false;
  std::string message;
  double seconds = 0;
};

Outcome run_bounded(std::function<void()> fn, const std::string& fifo = "",
                    std::chrono::seconds limit = 10s) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    Outcome out;
  };
  auto st = std::make_shared<State>();
  const auto t0 = std::chrono::steady_clock::now();
  std::thread([st, fn, t0] {
    Outcome o;
    try {
      fn();
    } catch (const Error& e) {
      o.threw = true;
      o.message = e.what();
    } catch (const std::exception& e) {
      o.threw = true;
      o.message = std::string("(not a spade::Error) ") + e.what();
    }
    o.finished = true;
    o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::lock_guard<std::mutex> lk(st->mu);
    st->out = o;
    st->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lk(st->mu);
  if (!st->cv.wait_for(lk, test::scaled(limit), [&] { return st->out.finished; })) {
    ADD_FAILURE() << "the loader did not answer within " << limit.count() << " s (x" << test::time_scale() << ")";
    if (!fifo.empty()) {
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) ::close(fd);
      st->cv.wait_for(lk, 5s, [&] { return st->out.finished; });
    }
    return st->out;
  }
  return st->out;
}

// `fn` fails within the limit with a spade::Error that names `path` and says why.
void expect_refused(const std::string& what, std::function<void()> fn, const std::string& path,
                    const std::string& why, const std::string& fifo = "") {
  SCOPED_TRACE(what);
  const Outcome o = run_bounded(std::move(fn), fifo);
  ASSERT_TRUE(o.finished);
  ASSERT_TRUE(o.threw) << "no error for " << path;
  EXPECT_NE(o.message.find(path), std::string::npos) << o.message;
  EXPECT_NE(o.message.find(why), std::string::npos) << o.message;
  EXPECT_LT(o.seconds, 5.0 * test::time_scale()) << o.message;
}

constexpr const char* kFifo = "is not a regular file (a FIFO)";
constexpr const char* kDir = "is not a regular file (a directory)";
constexpr const char* kDevice = "is not a regular file (a device or socket)";

// A copy of the stories260k Hugging Face fixture in a temp dir, with `name` replaced by a FIFO
// (or a directory).
struct ModelCopy {
  test::TempDir dir;
  std::string special;
  ModelCopy(const std::string& tag, const std::string& name, bool as_dir = false) : dir(tag) {
    for (const auto& e : fs::directory_iterator(kStories))
      if (e.path().filename() != name) fs::copy_file(e.path(), dir.file(e.path().filename()));
    special = dir.file(name);
    if (as_dir)
      fs::create_directory(special);
    else
      EXPECT_EQ(::mkfifo(special.c_str(), 0600), 0) << special;
  }
  std::string fifo() const { return fs::is_fifo(special) ? special : ""; }
};

TEST(NonRegularPaths, GgufPathIsAFifoADirectoryOrADevice) {
  test::TempDir d("np_gguf");
  const std::string fifo = d.file("model.gguf");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_refused("load_model(FIFO)", [&] { load_model(fifo); }, fifo, kFifo, fifo);
  expect_refused("TensorSource::open(FIFO)", [&] { TensorSource::open(fifo); }, fifo, kFifo, fifo);
  expect_refused("load_model(/dev/zero)", [] { load_model("/dev/zero"); }, "/dev/zero", kDevice);
  expect_refused("load_model(/dev/null)", [] { load_model("/dev/null"); }, "/dev/null", kDevice);
  // A directory without config.json whose only .gguf entry is a FIFO, or a directory.
  expect_refused("directory with a FIFO .gguf", [&] { load_model(d.path()); }, fifo, kFifo, fifo);
  test::TempDir d2("np_gguf_dir");
  fs::create_directory(d2.file("weights.gguf"));
  expect_refused("directory with a .gguf directory", [&] { load_model(d2.path()); },
                 d2.file("weights.gguf"), kDir);
}

TEST(NonRegularPaths, SafetensorsDirectoryEntries) {
  for (const char* name : {"model.safetensors", "config.json", "generation_config.json"}) {
    for (bool as_dir : {false, true}) {
      ModelCopy m(std::string("np_st_") + (as_dir ? "d" : "f"), name, as_dir);
      expect_refused(std::string(name) + (as_dir ? " as a directory" : " as a FIFO"),
                     [&] { load_model(m.dir.path()); }, m.special, as_dir ? kDir : kFifo,
                     m.fifo());
    }
  }
  // Named through one of its files: the directory is loaded, and its FIFO refused.
  ModelCopy m("np_st_named", "model.safetensors");
  expect_refused("model named by config.json", [&] { load_model(m.dir.file("config.json")); },
                 m.special, kFifo, m.fifo());
  expect_refused("model named by the FIFO itself", [&] { load_model(m.special); }, m.special,
                 kFifo, m.fifo());
}

TEST(NonRegularPaths, ShardedIndexAndShards) {
  {
    ModelCopy m("np_index", "model.safetensors.index.json");
    expect_refused("index is a FIFO", [&] { load_model(m.dir.path()); }, m.special, kFifo,
                   m.fifo());
  }
  {
    // An index naming a shard that is a FIFO.
    ModelCopy m("np_shard", "shard-1.safetensors");
    test::write_file(m.dir.file("model.safetensors.index.json"),
                     R"({"metadata": {}, "weight_map": {"model.norm.weight": "shard-1.safetensors"}})");
    expect_refused("shard is a FIFO", [&] { load_model(m.dir.path()); }, m.special, kFifo,
                   m.fifo());
  }
}

TEST(NonRegularPaths, TokenizerFiles) {
  for (const char* name : {"tokenizer.json", "tokenizer_config.json"}) {
    ModelCopy m("np_tok", name);
    expect_refused(std::string(name) + " as a FIFO", [&] { Tokenizer::load(m.dir.path()); },
                   m.special, kFifo, m.fifo());
  }
  {
    ModelCopy m("np_tok_model", "tokenizer.model");
    fs::remove(m.dir.file("tokenizer.json"));  // so that the directory loads tokenizer.model
    expect_refused("tokenizer.model as a FIFO", [&] { Tokenizer::load(m.dir.path()); },
                   m.special, kFifo, m.fifo());
  }
  {
    ModelCopy m("np_tok_jinja", "chat_template.jinja");
    expect_refused("chat_template.jinja as a FIFO", [&] { Tokenizer::load(m.dir.path()); },
                   m.special, kFifo, m.fifo());
  }
  test::TempDir d("np_tok_file");
  const std::string fifo = d.file("tokenizer.model");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_refused("--tokenizer FIFO", [&] { Tokenizer::load(fifo); }, fifo, kFifo, fifo);
  expect_refused("--tokenizer /dev/zero", [] { Tokenizer::load("/dev/zero"); }, "/dev/zero",
                 kDevice);
}

TEST(NonRegularPaths, SparseConfigHeadRolesAndBlasstConfig) {
  test::TempDir d("np_sparse");
  const std::string fifo = d.file("config.json");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::pair<const char*, std::function<void(const std::string&)>> entries[] = {
      {"--sparse-config", [](const std::string& p) { sparse::SparseConfig c; c.merge_json_file(p); }},
      {"head roles", [](const std::string& p) { sparse::HeadRoles::load(p); }},
      {"blasst config", [](const std::string& p) { sparse::read_blasst_config_a(p); }},
  };
  for (const auto& entry : entries) {
    const std::string what = entry.first;
    const auto& load = entry.second;
    expect_refused(std::string(what) + " FIFO", [&] { load(fifo); }, fifo, kFifo, fifo);
    expect_refused(std::string(what) + " /dev/zero", [&] { load("/dev/zero"); }, "/dev/zero",
                   kDevice);
    expect_refused(std::string(what) + " directory", [&] { load(d.path()); }, d.path(), kDir);
  }
}

// The regular files of the same fixture still load: the refusals are about the file type.
TEST(NonRegularPaths, RegularFixtureStillLoads) {
  EXPECT_EQ(load_model(kStories)->config.n_layers, 5);
  EXPECT_EQ(Tokenizer::load(kStories)->vocab_size(), 512);
}

}  // namespace
}  // namespace spade
