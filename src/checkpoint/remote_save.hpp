// save_checkpoint to an s3:// URL: each file uploaded in parts, with the layout a local save
// writes (save_layout.hpp).
#pragma once

#include <string>
#include <vector>

#include "hbmio/checkpoint.hpp"

namespace hbmio::detail {

Stats save_remote(const std::string& url, const std::vector<TensorToSave>& tensors, const SaveOptions& options);

}  // namespace hbmio::detail
