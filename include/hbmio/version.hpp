#pragma once
#include <string>
namespace hbmio {
std::string version();  // "0.1.0"
}
