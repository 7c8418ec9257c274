// A Jinja interpreter for chat templates (see chat_template.h): the public API over the
// interpreter's parts (chat_template_internal.h).
#include "torchspeed/data/chat_template.h"

#include "torchspeed/data/chat_template_internal.h"
#include "torchspeed/base/error.h"

namespace torchspeed::data {

using jinja::json;
using namespace jinja;

std::string python_json(const nlohmann::json& value, int indent, bool sort_keys) {
  JsonStyle st;
  st.indent = indent;
  st.sort_keys = sort_keys;
  st.item_sep = indent >= 0 ? "," : ", ";
  std::string out;
  py_json(ordered(value), st, 0, out);
  return out;
}

struct ChatTemplate::Impl {
  std::string origin;
  std::vector<NodeP> body;
};

ChatTemplate::ChatTemplate(const std::string& source, const std::string& origin) {
  auto impl = std::make_shared<Impl>();
  impl->origin = origin;
  try {
    impl->body = parse_template(source, origin);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {  // a malformed literal (std::stoul, ...): the template's fault
    TS_CHECK(false, origin, ": ", e.what());
  }
  impl_ = impl;
}

const std::string& ChatTemplate::origin() const { return impl_->origin; }

std::string ChatTemplate::render(const nlohmann::json& context) const { return render(ordered(context)); }

std::string ChatTemplate::render(const json& context) const {
  TS_CHECK(context.is_object() || context.is_null(), impl_->origin, ": the context must be an object");
  Renderer r(impl_->origin);
  r.scopes_.emplace_back();
  if (context.is_object()) {
    for (const auto& [k, v] : context.items()) r.scopes_.back()[k] = Value::of(v);
  }
  r.scopes_.emplace_back();  // the template's own top-level sets
  std::string out;
  try {
    r.render_body(impl_->body, out);
  } catch (const Error&) {
    throw;
  } catch (const json::exception& e) {  // a value of another type than the template expects
    TS_CHECK(false, impl_->origin, ": ", e.what());
  } catch (const BreakSignal&) {
    TS_CHECK(false, impl_->origin, ": break outside a loop");
  } catch (const ContinueSignal&) {
    TS_CHECK(false, impl_->origin, ": continue outside a loop");
  }
  return out;
}

}  // namespace torchspeed::data

