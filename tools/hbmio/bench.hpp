// `hbmio bench`: the article's table (POSIX read + cudaMemcpy vs io_uring vs GPUDirect Storage),
// measured on the machine at hand, with the hardware's own ceilings beside it.
#pragma once

namespace CLI {
class App;
}

namespace hbmio::cli {

// Registers the `bench` subcommand on `app`. Its callback runs the benchmark while app.parse()
// runs and stores the command's exit status in `exit_status` (1 when a backend read or wrote
// wrong data or broke mid-way, else 0); `exit_status` must outlive app.parse(). Bad arguments and
// setup failures are thrown (hbmio::Error, CLI::ParseError) for main() to report.
void add_bench_command(CLI::App& app, int& exit_status);

}  // namespace hbmio::cli
