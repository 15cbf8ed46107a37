// The JSON file of a `spade eval` run, which is also what makes a sweep resumable: every
// measurement is one record with a unique "key" (sub-command, task, length, sample,
// method); a rerun with the same output file loads it and skips the keys it holds. The file
// is rewritten atomically (temporary file + rename) after each batch of records, so an
// interrupted sweep loses at most the batch in flight.
//
// {"kind": "tasks" | "ppl" | "agree" | "recall", "meta": {...}, "commands": [...],
//  "runs": [{"meta": {...}, "records": N}, ...], "results": [{"key": ..., ...}, ...]}
//
// A resumed file has one command per run: "commands" and "runs" are parallel, "runs" holding
// each command's own meta (its --samples, placement, date, ...) and how many records it
// added. "meta" is the first command's (plus keys first met later): kept for the --device
// check and the plots, but the report states each command's values from "runs". Files
// written before "runs" existed get {"meta": null, "records": null} for their later commands
// (not recorded), and the first command's meta for the first.
#pragma once
#include <nlohmann/json.hpp>
#include <set>
#include <string>

namespace spade::eval {

class ResultFile {
 public:
  // Loads `path` if it exists (it must be of the same kind), else starts an empty document.
  // `meta` fills the keys "meta" lacks; `command` is appended to "commands" and {meta, 0
  // records} to "runs".
  ResultFile(std::string path, const std::string& kind, const nlohmann::json& meta,
             const std::string& command);
  bool has(const std::string& key) const { return keys_.count(key) > 0; }
  void add(nlohmann::json record);  // record["key"] must be new; counted to this command's run
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
