// A Hugging Face model directory: config.json plus its weights, either one
// model.safetensors or shards named by model.safetensors.index.json. Every
// file is memory-mapped once; tensors are looked up by their HF names.
#pragma once

#include <initializer_list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "worker/model/model_config.h"
#include "worker/model/safetensors.h"

namespace penumbra {

class Checkpoint {
 public:
  // Reads `model_dir`/config.json, then model.safetensors if present, else
  // model.safetensors.index.json ("weight_map": tensor name -> shard file in the
  // same directory). Errors name the file (and tensor) at fault: NotFound for a
  // missing file, Corruption for a malformed one or a tensor the index places
  // in a shard that lacks it, InvalidArgument for a bad config.json.
  static Result<Checkpoint> Open(const std::string& model_dir);

  Checkpoint(Checkpoint&&) noexcept = default;
  Checkpoint& operator=(Checkpoint&&) noexcept = default;

  const ModelConfig& config() const { return config_; }
  const std::string& dir() const { return dir_; }
  // The files that were mapped, in the order they were opened.
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  // Every tensor name, sorted.
  std::vector<std::string> TensorNames() const;

  bool Has(const std::string& name) const;
  // The tensor, which must have a float dtype (F32/F16/BF16) and exactly
  // `expected_shape`. NotFound names the tensor and directory; a wrong shape or
  // dtype is InvalidArgument naming the tensor, its file, and expected vs actual.
  // The pointer is valid while this Checkpoint lives.
  Result<const TensorInfo*> Get(const std::string& name, std::initializer_list<int64_t> expected_shape) const;
  Result<const TensorInfo*> Get(const std::string& name, const std::vector<int64_t>& expected_shape) const;

  // Checks that every tensor a Llama/Qwen2/Mistral decoder reads is present with
  // the shape config() implies and a float dtype (dtypes may differ between
  // tensors). Returns the first problem found.
  Status Validate() const;

 private:
  Checkpoint() = default;

  std::string dir_;
  ModelConfig config_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, const TensorInfo*> tensors_;
};

}  // namespace penumbra
