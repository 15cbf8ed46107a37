// ResultFile of src/eval/results.h.
#include "eval/results.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace spade::eval {

ResultFile::ResultFile(std::string path, const std::string& kind, const nlohmann::json& meta,
                       const std::string& command)
    : path_(std::move(path)) {
  std::ifstream f(path_);
  if (f.good()) {
    std::stringstream ss;
    ss << f.rdbuf();
    try {
      doc_ = nlohmann::json::parse(ss.str());
    } catch (const std::exception& e) {
      fail("cannot resume from '", path_, "': ", e.what());
    }
    SPADE_CHECK(doc_.value("kind", "") == kind, "'", path_, "' holds eval ",
                doc_.value("kind", "?"), " results, not ", kind);
  } else {
    doc_ = {{"kind", kind}, {"meta", nlohmann::json::object()}, {"commands", nlohmann::json::array()},
            {"results", nlohmann::json::array()}};
  }
  auto& runs = doc_["runs"];  // null (pre-"runs" file, or fresh) becomes an array
  if (!runs.is_array()) runs = nlohmann::json::array();
  const auto& cmds = doc_["commands"];
  // Commands of a file written before "runs": the first one's meta is "meta"; the others'
  // were not recorded.
  for (size_t i = runs.size(); i < cmds.size(); ++i)
    runs.push_back({{"meta", i == 0 ? doc_["meta"] : nlohmann::json()}, {"records", nullptr}});
  SPADE_CHECK(runs.size() == cmds.size(), "'", path_, "' has ", cmds.size(), " commands but ",
              runs.size(), " runs");
  for (auto it = meta.begin(); it != meta.end(); ++it)
    if (!doc_["meta"].contains(it.key())) doc_["meta"][it.key()] = it.value();
  doc_["commands"].push_back(command);
  runs.push_back({{"meta", meta}, {"records", 0}});
  for (const auto& r : doc_["results"]) keys_.insert(r.at("key").get<std::string>());
  loaded_ = keys_.size();
}

void ResultFile::add(nlohmann::json record) {
  const std::string key = record.at("key").get<std::string>();
  SPADE_CHECK(keys_.insert(key).second, "duplicate eval record '", key, "'");
  doc_["results"].push_back(std::move(record));
  auto& n = doc_["runs"].back()["records"];
  n = n.get<int64_t>() + 1;
}

void ResultFile::save() const {
  const std::string tmp = path_ + ".tmp";
  {
    std::ofstream f(tmp);
    SPADE_CHECK(f.good(), "cannot write '", tmp, "'");
    f << doc_.dump(1) << "\n";
    SPADE_CHECK(f.good(), "cannot write '", tmp, "'");
  }
  SPADE_CHECK(std::rename(tmp.c_str(), path_.c_str()) == 0, "cannot rename '", tmp, "' to '",
              path_, "'");
}

}  // namespace spade::eval
