// `spade calibrate blasst --device cuda [--sparse X+blasst]` (issue 37, item 5): the option's
// parsing and errors, checked before any model is loaded: a CPU-only build refuses --device cuda
// with a clear error; --sparse takes a BLASST stack only, inside a selector only on the GPU and
// only for the decode phase. The GPU run itself is the device's (tests/gpu/test_cuda_blasst_model
// covers the probe).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "test_util.h"

namespace {

struct Result {
  int rc = 0;
  std::string out;
};

std::string spade_binary() {
  char self[4096] = {};
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) return {};
  std::string dir(self, size_t(len));
  return dir.substr(0, dir.rfind('/')) + "/spade";
}

Result calibrate(const std::string& spade, const std::string& args,
                 const std::string& lengths = "64") {
  // The model and text exist, so an error about them would mean the checks came too late.
  const std::string model = spade::test::source_dir() + "/tests/fixtures/models/stories260k-hf";
  const std::string cmd = spade + " calibrate blasst --model " + model + " --text " + model +
                          "/config.json --target-sparsity 0.5 --lengths " + lengths + " --out /dev/null " +
                          args + " 2>&1";
  Result r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, got);
  r.rc = pclose(p);
  return r;
}

void expect_error(const std::string& spade, const std::string& args, const std::string& what) {
  const Result r = calibrate(spade, args);
  EXPECT_NE(r.rc, 0) << args << ": " << r.out;
  EXPECT_NE(r.out.find(what), std::string::npos) << args << ": " << r.out;
}

}  // namespace

TEST(CalibrateCli, DeviceAndPlacementErrors) {
  const std::string spade = spade_binary();
  if (spade.empty() || !std::ifstream(spade).good()) GTEST_SKIP() << spade << " not built";
  expect_error(spade, "--device tpu", "--device must be cpu or cuda");
  // --sparse: a BLASST stack only.
  expect_error(spade, "--sparse quest:budget=64", "calibrate blasst takes a BLASST stack");
  expect_error(spade, "--sparse twilight+quest", "calibrate blasst takes a BLASST stack");
  // Inside a selector: the GPU only, decode only.
  expect_error(spade, "--sparse quest+blasst:budget=64 --phase decode",
               "BLASST inside a selector calibrates on the GPU only (--device cuda)");
  expect_error(spade, "--sparse blasst:base=quest --phase decode",
               "BLASST inside a selector calibrates on the GPU only (--device cuda)");
  expect_error(spade, "--device cuda --sparse quest+blasst:budget=64",
               "--phase decode only");
  // CPU options the GPU kernels fix.
  expect_error(spade, "--device cuda --tile 32", "--tile is a CPU option");
#if !defined(SPADE_HAVE_CUDA)
  // A CPU-only build refuses --device cuda, with or without a placement.
  expect_error(spade, "--device cuda", "--device cuda: this build has no CUDA backend");
  expect_error(spade, "--device cuda --phase decode --sparse quest+blasst:budget=64",
               "--device cuda: this build has no CUDA backend");
#endif
  // Over full attention (blasst, full+blasst) --sparse is the CPU's own placement: accepted;
  // the run then stops at a length past the model's context, not at --sparse.
  for (const char* spec : {"blasst", "full+blasst", "blasst:base=full"}) {
    const Result r = calibrate(spade, std::string("--phase decode --sparse ") + spec, "100000");
    EXPECT_NE(r.rc, 0);
    EXPECT_NE(r.out.find("exceeds the model's context"), std::string::npos) << spec << ": " << r.out;
  }
}
