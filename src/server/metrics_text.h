// Prometheus text exposition (format 0.0.4) of the engine's and the HTTP layer's counters.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "engine/request_metrics.h"

namespace spade::server {

// HTTP responses by (route, status code).
using HttpCounts = std::map<std::pair<std::string, int>, uint64_t>;

std::string prometheus_text(const EngineMetrics& m, const HttpCounts& http,
                            const std::string& model_id);

}  // namespace spade::server
