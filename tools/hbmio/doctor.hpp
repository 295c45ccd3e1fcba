// `hbmio doctor`: the GPUDirect Storage deployment checklist, checked on the machine at hand.
#pragma once

namespace CLI {
class App;
}

namespace hbmio::cli {

// Registers the `doctor` subcommand on `app`. Its callback runs the checks while app.parse()
// runs and stores the exit status in `exit_status` (1 when any check FAILs, else 0);
// `exit_status` must outlive app.parse(). Bad arguments are thrown as CLI::ParseError.
void add_doctor_command(CLI::App& app, int& exit_status);

}  // namespace hbmio::cli
