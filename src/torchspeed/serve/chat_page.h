// The chat page `torchspeed serve` answers GET / with (as llama.cpp's server has one): a single
// HTML file with its script, talking to /v1/models and /v1/chat/completions.
#pragma once

namespace torchspeed::serve {

const char* chat_page_html();

}  // namespace torchspeed::serve
