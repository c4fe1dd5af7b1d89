// What the OpenAI gateway's route files (openai_gateway.cc,
// openai_batches.cc) share: answering, errors, the caller's key.
#pragma once

#include <cstdint>
#include <string>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "coordinator/openai/openai_api.h"

namespace penumbra::coordinator::openai_gateway {

void Reply(httplib::Response& res, int status, const nlohmann::json& body);
// OpenAI's error object with its status (and Retry-After when it has one).
void Fail(httplib::Response& res, const openai::ApiError& e);
// "Authorization: Bearer KEY" -> KEY; "" when absent.
std::string BearerKey(const httplib::Request& req);
// A seed for a sampled request that names none: each call draws anew.
int64_t RandomSeed();
// OpenAI's list object: {"object": "list", "data", "has_more", "first_id", "last_id"}.
nlohmann::json ListJson(nlohmann::json data, bool has_more);

}  // namespace penumbra::coordinator::openai_gateway
