// The JSON file of a `spade eval` run, which is also what makes a sweep resumable: every
// measurement is one record with a unique "key" (sub-command, task, length, sample,
// method); a rerun with the same output file loads it and skips the keys it holds. The file
// is rewritten atomically (temporary file + rename) after each batch of records, so an
// interrupted sweep loses at most the batch in flight.
//
// {"kind": "tasks" | "ppl" | "agree" | "recall", "meta": {...}, "commands": [...],
//  "results": [{"key": ..., ...}, ...]}
#pragma once
#include <nlohmann/json.hpp>
#include <set>
#include <string>

namespace spade::eval {

class ResultFile {
 public:
  // Loads `path` if it exists (it must be of the same kind), else starts an empty document.
  // `meta` fills the keys the document lacks; `command` is appended to "commands".
  ResultFile(std::string path, const std::string& kind, const nlohmann::json& meta,
             const std::string& command);
  bool has(const std::string& key) const { return keys_.count(key) > 0; }
  void add(nlohmann::json record);  // record["key"] must be new
  void save() const;
  const nlohmann::json& doc() const { return doc_; }
  size_t loaded() const { return loaded_; }

 private:
  std::string path_;
  nlohmann::json doc_;
  std::set<std::string> keys_;
  size_t loaded_ = 0;
};

}  // namespace spade::eval
