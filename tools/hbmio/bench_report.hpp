// `hbmio bench`: the report of a finished run, three ways: a text table for people, JSON with
// every figure and full note for programs, and an SVG bar chart.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_measure.hpp"
#include "hbmio/hbmio.hpp"

namespace hbmio::cli {

struct Report {
  Machine machine;
  std::string date, command, file_path, into;
  bool generated = false;  // the file is a sample the run made (and removes)
  std::uint64_t size = 0;
  unsigned runs = 0;
  Options options;
  std::vector<Row> rows;  // in the order measured
};

// The table: machine and settings, one block per group (read cold, read warm, write), and below
// them the numbered notes the rows point to. Every line fits in 120 columns (but a path or a
// word that is longer on its own).
std::string render_table(const Report& report);

// Every figure, the full notes and reasons, and the machine: the record to keep (schema_version 1).
nlohmann::json to_json(const Report& report);

// A self-contained SVG: per group, a throughput bar and a host-CPU bar per row, the bound as a
// dashed line, and the numbered notes below.
std::string render_svg(const Report& report);

}  // namespace hbmio::cli
