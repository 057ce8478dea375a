#include "common/checkpoint/quantization.h"

#include "common/checkpoint/json_fields.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

namespace tessera {
namespace {

using nlohmann::json;

constexpr float kFp8Max = 448.f;

// fn(begin, end) over [0, n) in slices on the machine's cores (make-model quantizes a 70B
// checkpoint's 560 linear layers through these loops). Each index is one slice's alone; below
// `serial_below` indices (cheap ones, such as a row's) one thread does them all.
template <typename Fn>
void parallel_for(int64_t n, Fn fn, int64_t serial_below = 256) {
  const int64_t threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 32);
  if (n < serial_below || threads == 1) {
    fn(int64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t per = (n + threads - 1) / threads;
  for (int64_t begin = 0; begin < n; begin += per) {
    pool.emplace_back(fn, begin, std::min(n, begin + per));
  }
  for (std::thread& t : pool) t.join();
}

using json_fields::Fields;

Status check_group_size(const Fields& f, int64_t group) {
  if (group == -1 || group == 32 || group == 64 || group == 128) return Status::ok();
  return f.error("group_size", "must be 32, 64, 128 or -1 (one group), got " +
                                   std::to_string(group));
}

Expected<QuantConfig> parse_awq(const Fields& f) {
  QuantConfig q;
  q.method = QuantMethod::kAwq;
  TESSERA_ASSIGN_OR_RETURN(std::string version, f.text_or("version", "gemm"));
  std::transform(version.begin(), version.end(), version.begin(), ::tolower);
  if (version != "gemm") {
    return f.error("version", "\"" + version +
                                  "\" is not supported: AWQ checkpoints are read in AutoAWQ's "
                                  "\"gemm\" layout (re-export with version=\"gemm\")");
  }
  TESSERA_ASSIGN_OR_RETURN(int64_t bits, f.integer_or(f.given("bits") ? "bits" : "w_bit", 4));
  if (bits != 4) return f.error("bits", "must be 4 for AWQ, got " + std::to_string(bits));
  q.bits = 4;
  TESSERA_ASSIGN_OR_RETURN(int64_t group,
                           f.integer_or(f.given("group_size") ? "group_size" : "q_group_size", 128));
  TESSERA_RETURN_IF_ERROR(check_group_size(f, group));
  if (group == -1) return f.error("group_size", "-1 is not an AWQ group size (32, 64 or 128)");
  q.group_size = group;
  TESSERA_ASSIGN_OR_RETURN(bool zero_point, f.boolean_or("zero_point", true));
  if (!zero_point) {
    return f.error("zero_point", "false is not supported (AWQ \"gemm\" checkpoints carry zeros)");
  }
  TESSERA_ASSIGN_OR_RETURN(q.ignored, f.strings("modules_to_not_convert"));
  return q;
}

Expected<QuantConfig> parse_gptq(const Fields& f) {
  QuantConfig q;
  q.method = QuantMethod::kGptq;
  TESSERA_ASSIGN_OR_RETURN(int64_t bits, f.integer_or("bits", 4));
  if (bits != 4 && bits != 8) {
    return f.error("bits", "must be 4 or 8, got " + std::to_string(bits));
  }
  q.bits = static_cast<int>(bits);
  TESSERA_ASSIGN_OR_RETURN(int64_t group, f.integer_or("group_size", 128));
  TESSERA_RETURN_IF_ERROR(check_group_size(f, group));
  q.group_size = group == -1 ? 0 : group;
  TESSERA_ASSIGN_OR_RETURN(q.desc_act, f.boolean_or("desc_act", false));
  TESSERA_ASSIGN_OR_RETURN(q.sym, f.boolean_or("sym", true));
  TESSERA_ASSIGN_OR_RETURN(bool lm_head, f.boolean_or("lm_head", false));
  if (lm_head) return f.error("lm_head", "true (a quantized lm_head) is not supported");
  TESSERA_ASSIGN_OR_RETURN(std::string format, f.text_or("checkpoint_format", "gptq"));
  if (format != "gptq" && format != "gptq_v2") {
    return f.error("checkpoint_format", "\"" + format +
                                            "\" is not supported (\"gptq\" or \"gptq_v2\")");
  }
  q.zero_offset = format == "gptq";
  TESSERA_ASSIGN_OR_RETURN(q.ignored, f.strings("modules_to_not_convert"));
  return q;
}

Expected<QuantConfig> parse_fp8(const Fields& f) {
  QuantConfig q;
  q.method = QuantMethod::kFp8;
  q.bits = 8;
  if (f.given("weight_block_size")) {
    return f.error("weight_block_size",
                   "is given: block-wise FP8 scales (DeepSeek's) are not supported; per-tensor "
                   "and per-channel scales are");
  }
  TESSERA_ASSIGN_OR_RETURN(std::string scheme, f.text_or("activation_scheme", "dynamic"));
  if (scheme == "static") {
    q.activations = Fp8Activations::kStatic;
  } else if (scheme != "dynamic") {
    return f.error("activation_scheme", "must be \"dynamic\" or \"static\", got \"" + scheme + "\"");
  }
  TESSERA_ASSIGN_OR_RETURN(q.ignored, f.strings("ignored_layers"));
  return q;
}

// compressed-tensors (llm-compressor): FP8 weights, per tensor or per channel, with dynamic
// per-token, static or no activation quantization.
Expected<QuantConfig> parse_compressed_tensors(const json& j, const Fields& f,
                                               const std::string& file) {
  QuantConfig q;
  q.method = QuantMethod::kFp8;
  q.bits = 8;
  TESSERA_ASSIGN_OR_RETURN(std::string format, f.text_or("format", "float-quantized"));
  if (format != "float-quantized" && format != "naive-quantized") {
    return f.error("format", "\"" + format +
                                 "\" is not supported: compressed-tensors checkpoints are read "
                                 "with FP8 weights (\"float-quantized\")");
  }
  if (!f.given("config_groups") || !j.at("config_groups").is_object() ||
      j.at("config_groups").size() != 1) {
    return f.error("config_groups", "must hold exactly one scheme (one for every Linear)");
  }
  const auto first = j.at("config_groups").begin();
  const std::string group_name = first.key();
  const json& group = first.value();
  const std::string prefix = "quantization_config.config_groups." + group_name + ".";
  if (!group.is_object() || !group.contains("weights") || !group["weights"].is_object()) {
    return invalid_argument(file + ": " + prefix + "weights is missing");
  }
  const json& wj = group["weights"];
  Fields w(wj, file, prefix + "weights.");
  TESSERA_ASSIGN_OR_RETURN(int64_t bits, w.integer_or("num_bits", 0));
  TESSERA_ASSIGN_OR_RETURN(std::string type, w.text_or("type", ""));
  if (bits != 8 || type != "float") {
    return invalid_argument(file + ": " + prefix + "weights is " + std::to_string(bits) +
                            "-bit " + (type.empty() ? "?" : type) +
                            ": only 8-bit float (FP8) compressed-tensors checkpoints are "
                            "supported; for int4 use an AWQ or GPTQ export");
  }
  TESSERA_ASSIGN_OR_RETURN(std::string strategy, w.text_or("strategy", "tensor"));
  if (strategy == "channel") {
    q.weight_scale = Fp8Scale::kChannel;
  } else if (strategy != "tensor") {
    return w.error("strategy", "\"" + strategy + "\" is not supported (\"tensor\" or \"channel\")");
  }
  TESSERA_ASSIGN_OR_RETURN(bool dynamic_weights, w.boolean_or("dynamic", false));
  if (dynamic_weights) return w.error("dynamic", "true is not supported for weights");
  if (!group.contains("input_activations") || group["input_activations"].is_null()) {
    q.activations = Fp8Activations::kNone;
  } else {
    Fields a(group["input_activations"], file, prefix + "input_activations.");
    TESSERA_ASSIGN_OR_RETURN(int64_t abits, a.integer_or("num_bits", 0));
    TESSERA_ASSIGN_OR_RETURN(std::string atype, a.text_or("type", ""));
    if (abits != 8 || atype != "float") {
      return invalid_argument(file + ": " + prefix +
                              "input_activations must be 8-bit float (FP8), got " +
                              std::to_string(abits) + "-bit " + atype);
    }
    TESSERA_ASSIGN_OR_RETURN(bool dynamic, a.boolean_or("dynamic", false));
    q.activations = dynamic ? Fp8Activations::kDynamic : Fp8Activations::kStatic;
  }
  TESSERA_ASSIGN_OR_RETURN(q.ignored, f.strings("ignore"));
  return q;
}

// Bits `bits` wide at `shift` of `word`.
inline uint8_t field(int32_t word, int shift, int bits) {
  return static_cast<uint8_t>((static_cast<uint32_t>(word) >> shift) & ((1u << bits) - 1u));
}

Status missing(const std::string& name, const char* part, const QuantConfig& q) {
  return invalid_argument(name + "." + part + " is missing (" + q.describe() +
                          " linear layers need " +
                          (q.method == QuantMethod::kFp8 ? "weight and weight_scale"
                           : q.method == QuantMethod::kGptq
                               ? "qweight, qzeros, scales and g_idx"
                               : "qweight, qzeros and scales") +
                          ")");
}

Status bad_shape(const std::string& name, const char* part, const TensorView& t,
                 const std::string& expected) {
  return invalid_argument(name + "." + part + " is " + t.describe() + ", expected " + expected);
}

std::string dims(std::initializer_list<int64_t> d) {
  std::string s = "[";
  for (auto it = d.begin(); it != d.end(); ++it) {
    s += (it == d.begin() ? "" : ", ") + std::to_string(*it);
  }
  return s + "]";
}

bool is_float(DType d) { return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16; }

Expected<std::vector<float>> dequantize_awq(const LinearWeight& w, const QuantConfig& q,
                                            const std::string& name) {
  if (w.qzeros.data == nullptr) return missing(name, "qzeros", q);
  if (w.scales.data == nullptr) return missing(name, "scales", q);
  const TensorView& qw = w.qweight;
  if (qw.dtype != DType::kI32 || qw.shape.size() != 2) {
    return bad_shape(name, "qweight", qw, "an I32 [in, out / 8] matrix");
  }
  const int64_t in = qw.shape[0], out = qw.shape[1] * 8;
  const int64_t group = q.group(in);
  if (in % group != 0) {
    return bad_shape(name, "qweight", qw,
                     std::to_string(in) + " input rows, a multiple of the group size " +
                         std::to_string(group));
  }
  const int64_t groups = in / group;
  if (w.qzeros.dtype != DType::kI32 || w.qzeros.shape != std::vector<int64_t>{groups, out / 8}) {
    return bad_shape(name, "qzeros", w.qzeros, dims({groups, out / 8}) + " I32");
  }
  if (!is_float(w.scales.dtype) || w.scales.shape != std::vector<int64_t>{groups, out}) {
    return bad_shape(name, "scales", w.scales, dims({groups, out}) + " F16");
  }
  const auto* qp = static_cast<const int32_t*>(qw.data);
  const auto* zp = static_cast<const int32_t*>(w.qzeros.data);
  std::vector<float> result(static_cast<size_t>(out * in));
  for (int64_t i = 0; i < in; ++i) {
    const int64_t g = i / group;
    for (int64_t c = 0; c < out / 8; ++c) {
      const int32_t word = qp[i * (out / 8) + c];
      const int32_t zword = zp[g * (out / 8) + c];
      for (int n = 0; n < 8; ++n) {
        const int64_t o = c * 8 + kAwqOrder[n];
        const float s = w.scales.at(g * out + o);
        const int v = field(word, 4 * n, 4), z = field(zword, 4 * n, 4);
        result[static_cast<size_t>(o * in + i)] = static_cast<float>(v - z) * s;
      }
    }
  }
  return result;
}

Expected<std::vector<float>> dequantize_gptq(const LinearWeight& w, const QuantConfig& q,
                                             const std::string& name) {
  if (w.qzeros.data == nullptr) return missing(name, "qzeros", q);
  if (w.scales.data == nullptr) return missing(name, "scales", q);
  if (w.g_idx.data == nullptr) return missing(name, "g_idx", q);
  const int bits = q.bits;
  const int64_t pack = q.pack_factor();
  const TensorView& qw = w.qweight;
  if (qw.dtype != DType::kI32 || qw.shape.size() != 2) {
    return bad_shape(name, "qweight", qw, "an I32 [in / " + std::to_string(pack) + ", out] matrix");
  }
  const int64_t in = qw.shape[0] * pack, out = qw.shape[1];
  if (out % pack != 0) {
    return bad_shape(name, "qweight", qw,
                     "a multiple of " + std::to_string(pack) + " output columns");
  }
  if (!is_float(w.scales.dtype) || w.scales.shape.size() != 2 || w.scales.shape[1] != out) {
    return bad_shape(name, "scales", w.scales, "[groups, " + std::to_string(out) + "] F16");
  }
  const int64_t groups = w.scales.shape[0];
  if (w.qzeros.dtype != DType::kI32 ||
      w.qzeros.shape != std::vector<int64_t>{groups, out / pack}) {
    return bad_shape(name, "qzeros", w.qzeros, dims({groups, out / pack}) + " I32");
  }
  if (w.g_idx.dtype != DType::kI32 || w.g_idx.shape != std::vector<int64_t>{in}) {
    return bad_shape(name, "g_idx", w.g_idx, dims({in}) + " I32");
  }
  const auto* gp = static_cast<const int32_t*>(w.g_idx.data);
  for (int64_t i = 0; i < in; ++i) {
    if (gp[i] < 0 || gp[i] >= groups) {
      return invalid_argument(name + ".g_idx[" + std::to_string(i) + "] is " +
                              std::to_string(gp[i]) + ", outside the " + std::to_string(groups) +
                              " groups of its scales");
    }
  }
  const auto* qp = static_cast<const int32_t*>(qw.data);
  const auto* zp = static_cast<const int32_t*>(w.qzeros.data);
  const int offset = q.zero_offset ? 1 : 0;
  std::vector<float> result(static_cast<size_t>(out * in));
  for (int64_t i = 0; i < in; ++i) {
    const int64_t g = gp[i];
    const int64_t r = i / pack;
    const int shift = static_cast<int>(i % pack) * bits;
    for (int64_t o = 0; o < out; ++o) {
      const int v = field(qp[r * out + o], shift, bits);
      const int z =
          field(zp[g * (out / pack) + o / pack], static_cast<int>(o % pack) * bits, bits) + offset;
      result[static_cast<size_t>(o * in + i)] =
          static_cast<float>(v - z) * w.scales.at(g * out + o);
    }
  }
  return result;
}

Expected<std::vector<float>> dequantize_fp8(const LinearWeight& w, const QuantConfig& q,
                                            const std::string& name) {
  TESSERA_ASSIGN_OR_RETURN(const std::vector<float> scales, fp8_weight_scales(w, q, name));
  const TensorView& t = w.weight;
  const int64_t out = t.shape[0], in = t.shape[1];
  const auto* p = static_cast<const uint8_t*>(t.data);
  std::vector<float> result(static_cast<size_t>(out * in));
  for (int64_t o = 0; o < out; ++o) {
    const float scale = scales[static_cast<size_t>(o)];
    for (int64_t i = 0; i < in; ++i) {
      result[static_cast<size_t>(o * in + i)] = fp8_e4m3_to_float(p[o * in + i]) * scale;
    }
  }
  return result;
}

}  // namespace

Expected<std::vector<float>> fp8_weight_scales(const LinearWeight& w, const QuantConfig& q,
                                               const std::string& name) {
  const TensorView& t = w.weight;
  if (t.dtype != DType::kF8E4M3 || t.shape.size() != 2) {
    return bad_shape(name, "weight", t, "an F8_E4M3 [out, in] matrix");
  }
  if (w.weight_scale.data == nullptr) return missing(name, "weight_scale", q);
  const int64_t out = t.shape[0];
  const TensorView& s = w.weight_scale;
  const int64_t n = s.numel();
  if (!is_float(s.dtype) || (n != 1 && n != out) || s.shape.size() > 2) {
    return bad_shape(name, "weight_scale", s,
                     "one F32 scale ([] or [1]) or one per output feature ([" +
                         std::to_string(out) + ", 1])");
  }
  std::vector<float> scales(static_cast<size_t>(out));
  for (int64_t o = 0; o < out; ++o) {
    const float scale = s.at(n == 1 ? 0 : o);
    if (!(scale > 0) || !std::isfinite(scale)) {
      return invalid_argument(name + ".weight_scale holds " + std::to_string(scale) +
                              ", not a positive finite scale");
    }
    scales[static_cast<size_t>(o)] = scale;
  }
  return scales;
}

Expected<QuantMethod> parse_quant_method(std::string_view text) {
  if (text == "auto") return QuantMethod::kAuto;
  if (text == "none") return QuantMethod::kNone;
  if (text == "awq" || text == "awq_marlin") return QuantMethod::kAwq;
  if (text == "gptq" || text == "gptq_marlin") return QuantMethod::kGptq;
  if (text == "fp8") return QuantMethod::kFp8;
  return invalid_argument("--quantization " + std::string(text) +
                          " is not supported (awq, awq_marlin, gptq, gptq_marlin, fp8 or none)");
}

const char* quant_method_name(QuantMethod method) {
  switch (method) {
    case QuantMethod::kAuto:
      return "auto";
    case QuantMethod::kNone:
      return "none";
    case QuantMethod::kAwq:
      return "awq";
    case QuantMethod::kGptq:
      return "gptq";
    case QuantMethod::kFp8:
      return "fp8";
  }
  return "?";
}

std::string QuantConfig::describe() const {
  switch (method) {
    case QuantMethod::kAwq:
    case QuantMethod::kGptq: {
      std::string s = std::string(quant_method_name(method)) + " (" + std::to_string(bits) +
                      "-bit, " +
                      (group_size > 0 ? "group " + std::to_string(group_size) : "one group");
      if (method == QuantMethod::kGptq) {
        s += std::string(desc_act ? ", desc_act" : "") + (sym ? ", sym" : ", asym");
      }
      return s + ")";
    }
    case QuantMethod::kFp8:
      return std::string("fp8 (") + (online ? "quantized at load, " : "") +
             (weight_scale == Fp8Scale::kTensor ? "per-tensor" : "per-channel") + " weights, " +
             (activations == Fp8Activations::kDynamic  ? "dynamic per-token activations"
              : activations == Fp8Activations::kStatic ? "static activation scales"
                                                       : "bf16 activations") +
             ")";
    default:
      return quant_method_name(method);
  }
}

bool QuantConfig::quantizes(const std::string& module) const {
  if (method == QuantMethod::kNone || method == QuantMethod::kAuto) return false;
  for (const std::string& pattern : ignored) {
    if (pattern.rfind("re:", 0) == 0) {
      try {
        if (std::regex_match(module, std::regex(pattern.substr(3)))) return false;
      } catch (const std::regex_error&) {
        continue;  // checked when parsed
      }
    } else if (module == pattern || (module.size() > pattern.size() &&
                                     module.compare(module.size() - pattern.size(),
                                                    pattern.size(), pattern) == 0 &&
                                     module[module.size() - pattern.size() - 1] == '.')) {
      return false;
    }
  }
  return true;
}

Expected<QuantConfig> parse_quantization_config(const std::string& json_text,
                                                const std::string& file) {
  json j = json::parse(json_text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return invalid_argument(file + ": quantization_config must be an object");
  }
  Fields f(j, file, "quantization_config.");
  if (!f.given("quant_method")) {
    return f.error("quant_method", "is missing (awq, gptq, fp8 or compressed-tensors)");
  }
  TESSERA_ASSIGN_OR_RETURN(std::string method, f.text_or("quant_method", ""));
  Expected<QuantConfig> q = invalid_argument("");
  if (method == "awq") {
    q = parse_awq(f);
  } else if (method == "gptq") {
    q = parse_gptq(f);
  } else if (method == "fp8") {
    q = parse_fp8(f);
  } else if (method == "compressed-tensors") {
    q = parse_compressed_tensors(j, f, file);
  } else {
    return f.error("quant_method", "\"" + method +
                                       "\" is not supported (awq, gptq, fp8 or "
                                       "compressed-tensors with FP8 weights)");
  }
  if (!q) return q.status();
  for (const std::string& pattern : q->ignored) {
    if (pattern.rfind("re:", 0) != 0) continue;
    try {
      std::regex check(pattern.substr(3));
    } catch (const std::regex_error&) {
      return invalid_argument(file + ": quantization_config ignores \"" + pattern +
                              "\", which is not a regular expression");
    }
  }
  return q;
}

Expected<QuantConfig> resolve_quantization(QuantMethod flag, const QuantConfig& checkpoint) {
  const QuantMethod have = checkpoint.method;
  if (flag == QuantMethod::kAuto || flag == have) return checkpoint;
  if (flag == QuantMethod::kFp8 && have == QuantMethod::kNone) {
    QuantConfig q;
    q.method = QuantMethod::kFp8;
    q.bits = 8;
    q.online = true;
    return q;
  }
  if (have == QuantMethod::kNone) {
    return invalid_argument(std::string("--quantization ") + quant_method_name(flag) +
                            " needs a checkpoint quantized with it, and this one has no "
                            "quantization_config (plain weights); drop the flag, or use "
                            "--quantization fp8 to quantize at load");
  }
  return invalid_argument(std::string("--quantization ") + quant_method_name(flag) +
                          " contradicts the checkpoint, which is " + checkpoint.describe() +
                          " (config.json quantization_config); drop the flag or pass "
                          "--quantization " +
                          quant_method_name(have));
}

std::vector<int32_t> pack_awq(std::span<const uint8_t> q, int64_t rows, int64_t cols) {
  std::vector<int32_t> out(static_cast<size_t>(rows * (cols / 8)), 0);
  parallel_for(rows, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      for (int64_t c = 0; c < cols / 8; ++c) {
        uint32_t word = 0;
        for (int n = 0; n < 8; ++n) {
          word |= static_cast<uint32_t>(q[r * cols + c * 8 + kAwqOrder[n]] & 0xf) << (4 * n);
        }
        out[r * (cols / 8) + c] = static_cast<int32_t>(word);
      }
    }
  });
  return out;
}

std::vector<uint8_t> unpack_awq(std::span<const int32_t> packed, int64_t rows, int64_t cols) {
  std::vector<uint8_t> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols / 8; ++c) {
      for (int n = 0; n < 8; ++n) {
        out[r * cols + c * 8 + kAwqOrder[n]] = field(packed[r * (cols / 8) + c], 4 * n, 4);
      }
    }
  }
  return out;
}

std::vector<int32_t> pack_rows(std::span<const uint8_t> q, int64_t rows, int64_t cols, int bits) {
  const int64_t p = 32 / bits;
  const uint32_t mask = (1u << bits) - 1u;
  std::vector<int32_t> out(static_cast<size_t>((rows / p) * cols), 0);
  parallel_for(rows / p, [&](int64_t first, int64_t last) {  // by packed row: one word each
    for (int64_t r = first * p; r < last * p; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        auto& word = reinterpret_cast<uint32_t&>(out[(r / p) * cols + c]);
        word |= (q[r * cols + c] & mask) << ((r % p) * bits);
      }
    }
  });
  return out;
}

std::vector<uint8_t> unpack_rows(std::span<const int32_t> packed, int64_t rows, int64_t cols,
                                 int bits) {
  const int64_t p = 32 / bits;
  std::vector<uint8_t> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[r * cols + c] = field(packed[(r / p) * cols + c], static_cast<int>(r % p) * bits, bits);
    }
  }
  return out;
}

std::vector<int32_t> pack_cols(std::span<const uint8_t> q, int64_t rows, int64_t cols, int bits) {
  const int64_t p = 32 / bits;
  const uint32_t mask = (1u << bits) - 1u;
  std::vector<int32_t> out(static_cast<size_t>(rows * (cols / p)), 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      auto& word = reinterpret_cast<uint32_t&>(out[r * (cols / p) + c / p]);
      word |= (q[r * cols + c] & mask) << ((c % p) * bits);
    }
  }
  return out;
}

std::vector<uint8_t> unpack_cols(std::span<const int32_t> packed, int64_t rows, int64_t cols,
                                 int bits) {
  const int64_t p = 32 / bits;
  std::vector<uint8_t> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[r * cols + c] = field(packed[r * (cols / p) + c / p], static_cast<int>(c % p) * bits, bits);
    }
  }
  return out;
}

int64_t LinearWeight::out_features(const QuantConfig& /*q*/) const {
  switch (method) {
    case QuantMethod::kAwq:
      return qweight.shape.at(1) * 8;
    case QuantMethod::kGptq:
      return qweight.shape.at(1);
    default:
      return weight.shape.at(0);
  }
}

int64_t LinearWeight::in_features(const QuantConfig& q) const {
  switch (method) {
    case QuantMethod::kAwq:
      return qweight.shape.at(0);
    case QuantMethod::kGptq:
      return qweight.shape.at(0) * q.pack_factor();
    default:
      return weight.shape.at(1);
  }
}

uint64_t LinearWeight::bytes() const {
  uint64_t b = 0;
  for (const TensorView* t : {&weight, &qweight, &qzeros, &scales, &g_idx, &weight_scale,
                              &input_scale}) {
    if (t->data != nullptr) b += t->bytes();
  }
  return b;
}

Expected<std::vector<float>> dequantize(const LinearWeight& w, const QuantConfig& q,
                                        const std::string& name) {
  switch (w.method) {
    case QuantMethod::kAwq:
      if (w.qweight.data == nullptr) return missing(name, "qweight", q);
      return dequantize_awq(w, q, name);
    case QuantMethod::kGptq:
      if (w.qweight.data == nullptr) return missing(name, "qweight", q);
      return dequantize_gptq(w, q, name);
    case QuantMethod::kFp8:
      if (w.weight.data == nullptr) return missing(name, "weight", q);
      return dequantize_fp8(w, q, name);
    default:
      break;
  }
  const TensorView& t = w.weight;
  if (t.data == nullptr) return invalid_argument(name + ".weight is missing");
  if (!is_float(t.dtype) || t.shape.size() != 2) {
    return bad_shape(name, "weight", t, "an F32/F16/BF16 [out, in] matrix");
  }
  std::vector<float> result(static_cast<size_t>(t.numel()));
  for (int64_t r = 0; r < t.shape[0]; ++r) t.row_to_float(r, result.data() + r * t.shape[1]);
  return result;
}

Fp8Weight quantize_fp8(const TensorView& weight) {
  const int64_t n = weight.numel();
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(weight.at(i)));
  Fp8Weight out;
  out.scale = amax > 0 ? amax / kFp8Max : 1.f;
  out.data.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out.data[i] = float_to_fp8_e4m3(weight.at(i) / out.scale);
  return out;
}

float shared_input_scale(std::initializer_list<const LinearWeight*> layers) {
  float scale = 0.f;
  for (const LinearWeight* w : layers) {
    if (w->input_scale.data != nullptr) scale = std::max(scale, w->input_scale.at(0));
  }
  return scale;
}

void fake_quantize_fp8_activations(std::span<float> x, int64_t rows, int64_t cols,
                                   float input_scale) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x.data() + r * cols;
    float a = input_scale;
    if (!(a > 0)) {
      float amax = 0.f;
      for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(row[c]));
      a = amax > 0 ? amax / kFp8Max : 1.f;
    }
    for (int64_t c = 0; c < cols; ++c) {
      row[c] = fp8_e4m3_to_float(float_to_fp8_e4m3(row[c] / a)) * a;
    }
  }
}

namespace {

template <typename T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> out(v.size() * sizeof(T));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// Integer weights of one group and output column, by the group's range: the scale (rounded to
// F16, as stored) and the zero point. sym: zero in the middle, the scale from the largest
// magnitude.
struct GroupScale {
  float scale;
  int zero;
};
// `s` as the F16 it is stored as, rounded up, so the group's range still fits the integers.
float f16_at_least(float s) {
  uint16_t h = float_to_f16(s);
  if (f16_to_float(h) < s) ++h;  // positive: the next F16 up
  return f16_to_float(h);
}

// std::lround for |v| < 2^31, inline: the truncation, then a step away from zero at .5 (v - t
// is exact in float).
inline int round_half_away(float v) {
  const int t = static_cast<int>(v);
  const float d = v - static_cast<float>(t);
  return t + (d >= 0.5f ? 1 : 0) - (d <= -0.5f ? 1 : 0);
}

GroupScale group_scale(float lo, float hi, int bits, bool sym, int min_zero) {
  const int maxq = (1 << bits) - 1;
  if (sym) {
    const float m = std::max(std::fabs(lo), std::fabs(hi));
    return {f16_at_least(m > 0 ? 2.f * m / static_cast<float>(maxq) : 1e-3f), (maxq + 1) / 2};
  }
  lo = std::min(lo, 0.f);
  hi = std::max(hi, 0.f);
  const float s = f16_at_least(hi > lo ? (hi - lo) / static_cast<float>(maxq) : 1e-3f);
  const int zero = std::clamp(static_cast<int>(std::lround(-lo / s)), min_zero, maxq);
  return {s, zero};
}

}  // namespace

std::string quantization_config_json(const QuantConfig& q) {
  json j;
  switch (q.method) {
    case QuantMethod::kAwq:
      j = {{"quant_method", "awq"},
           {"bits", q.bits},
           {"group_size", q.group_size},
           {"zero_point", true},
           {"version", "gemm"},
           {"modules_to_not_convert", q.ignored.empty() ? json(nullptr) : json(q.ignored)}};
      break;
    case QuantMethod::kGptq:
      j = {{"quant_method", "gptq"},
           {"bits", q.bits},
           {"group_size", q.group_size > 0 ? q.group_size : -1},
           {"desc_act", q.desc_act},
           {"sym", q.sym},
           {"lm_head", false},
           {"damp_percent", 0.01},
           {"true_sequential", true},
           {"checkpoint_format", q.zero_offset ? "gptq" : "gptq_v2"}};
      if (!q.ignored.empty()) j["modules_to_not_convert"] = q.ignored;
      break;
    case QuantMethod::kFp8:
      if (q.weight_scale == Fp8Scale::kTensor && q.activations != Fp8Activations::kNone) {
        j = {{"quant_method", "fp8"},
             {"activation_scheme",
              q.activations == Fp8Activations::kStatic ? "static" : "dynamic"},
             {"ignored_layers", q.ignored}};
        break;
      }
      {
        json weights = {{"num_bits", 8}, {"type", "float"}, {"symmetric", true},
                        {"dynamic", false},
                        {"strategy", q.weight_scale == Fp8Scale::kChannel ? "channel" : "tensor"}};
        json activations = nullptr;
        if (q.activations != Fp8Activations::kNone) {
          const bool dynamic = q.activations == Fp8Activations::kDynamic;
          activations = {{"num_bits", 8}, {"type", "float"}, {"symmetric", true},
                         {"dynamic", dynamic}, {"strategy", dynamic ? "token" : "tensor"}};
        }
        j = {{"quant_method", "compressed-tensors"},
             {"format", "float-quantized"},
             {"quantization_status", "compressed"},
             {"config_groups",
              {{"group_0",
                {{"targets", {"Linear"}},
                 {"weights", weights},
                 {"input_activations", activations}}}}},
             {"ignore", q.ignored.empty() ? json::array({"lm_head"}) : json(q.ignored)}};
      }
      break;
    default:
      j = json::object();
      break;
  }
  return j.dump();
}

Status check_linear_shape(const QuantConfig& q, int64_t out, int64_t in, const std::string& name) {
  if (q.method != QuantMethod::kAwq && q.method != QuantMethod::kGptq) return Status::ok();
  const int64_t pack = q.method == QuantMethod::kAwq ? 8 : q.pack_factor();
  if (out % pack != 0 || in % pack != 0) {
    return invalid_argument(name + " [" + std::to_string(out) + ", " + std::to_string(in) +
                            "] does not pack into " + q.describe() + ": both sizes must be " +
                            "multiples of " + std::to_string(pack));
  }
  if (in % q.group(in) != 0) {
    return invalid_argument(name + " has " + std::to_string(in) + " input features, not whole " +
                            q.describe() + " groups of " + std::to_string(q.group(in)));
  }
  return Status::ok();
}

std::vector<QuantizedPart> quantize_linear(std::span<const float> w, int64_t out, int64_t in,
                                           const QuantConfig& q, uint64_t seed) {
  return quantize_linear(
      [&](int64_t first, int64_t last, float* dst) {
        std::memcpy(dst, w.data() + first * in, static_cast<size_t>((last - first) * in) * 4);
      },
      out, in, q, seed);
}

std::vector<QuantizedPart> quantize_linear(const WeightRows& rows, int64_t out, int64_t in,
                                           const QuantConfig& q, uint64_t seed) {
  std::vector<QuantizedPart> parts;
  if (q.method == QuantMethod::kFp8) {
    std::vector<float> w(static_cast<size_t>(out * in));
    parallel_for(out,
                 [&](int64_t first, int64_t last) { rows(first, last, w.data() + first * in); });
    const bool channel = q.weight_scale == Fp8Scale::kChannel;
    std::vector<uint8_t> bytes(static_cast<size_t>(out * in));
    std::vector<float> row_max(static_cast<size_t>(out), 0.f);
    parallel_for(out, [&](int64_t first, int64_t last) {
      for (int64_t o = first; o < last; ++o) {
        for (int64_t i = 0; i < in; ++i) row_max[o] = std::max(row_max[o], std::fabs(w[o * in + i]));
      }
    });
    std::vector<float> scales =
        channel ? row_max
                : std::vector<float>{*std::max_element(row_max.begin(), row_max.end())};
    for (float& s : scales) s = s > 0 ? s / kFp8Max : 1.f;
    parallel_for(out, [&](int64_t first, int64_t last) {
      for (int64_t o = first; o < last; ++o) {
        const float s = scales[channel ? static_cast<size_t>(o) : 0];
        for (int64_t i = 0; i < in; ++i) bytes[o * in + i] = float_to_fp8_e4m3(w[o * in + i] / s);
      }
    });
    parts.push_back({"weight", DType::kF8E4M3, {out, in}, std::move(bytes)});
    parts.push_back({"weight_scale", DType::kF32,
                     channel ? std::vector<int64_t>{out, 1} : std::vector<int64_t>{1},
                     as_bytes(scales)});
    if (q.activations == Fp8Activations::kStatic) {
      parts.push_back({"input_scale", DType::kF32, {1}, as_bytes(std::vector<float>{8.f / kFp8Max})});
    }
    return parts;
  }
  const int bits = q.bits;
  const int64_t g = q.group(in);
  const int64_t groups = (in + g - 1) / g;
  // g_idx: group of each input; desc_act: a permutation's (inputs in the order `perm` visits
  // them fill the groups one after another).
  std::vector<int32_t> g_idx(static_cast<size_t>(in));
  std::vector<int64_t> perm(static_cast<size_t>(in));
  for (int64_t i = 0; i < in; ++i) perm[i] = i;
  if (q.method == QuantMethod::kGptq && q.desc_act) {
    uint64_t state = seed ^ 0x9e3779b97f4a7c15ull;
    for (int64_t i = in - 1; i > 0; --i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      std::swap(perm[i], perm[(state >> 33) % static_cast<uint64_t>(i + 1)]);
    }
  }
  for (int64_t k = 0; k < in; ++k) g_idx[perm[k]] = static_cast<int32_t>(k / g);
  const bool sym = q.method == QuantMethod::kGptq && q.sym;
  // GPTQ's stored zero - 1 cannot hold -1: asymmetric zeros start at 1.
  const int min_zero = q.method == QuantMethod::kGptq && q.zero_offset ? 1 : 0;
  const int maxq = (1 << bits) - 1;
  std::vector<uint16_t> scales(static_cast<size_t>(groups * out));
  std::vector<uint8_t> zeros(scales.size());
  std::vector<uint8_t> ints(static_cast<size_t>(in * out));  // [in, out]
  // By blocks of kBlock outputs, each made, ranged, scaled and rounded while it is in cache (a
  // 70B layer's floats are never all in memory); each input's row of a block is one contiguous
  // write of the [in, out] ints.
  constexpr int64_t kBlock = 64;
  parallel_for(
      (out + kBlock - 1) / kBlock,
      [&](int64_t first, int64_t last) {
        std::vector<float> w(static_cast<size_t>(kBlock * in));
        std::vector<float> lo(static_cast<size_t>(kBlock * groups)), hi(lo.size()),
            scale_f(lo.size());
        std::vector<uint8_t> zero(lo.size());
        for (int64_t b = first; b < last; ++b) {
          const int64_t o0 = b * kBlock, o1 = std::min(out, o0 + kBlock), n = o1 - o0;
          rows(o0, o1, w.data());
          std::fill(lo.begin(), lo.end(), 0.f);
          std::fill(hi.begin(), hi.end(), 0.f);
          for (int64_t r = 0; r < n; ++r) {  // per group and output: the range
            const float* row = w.data() + r * in;
            float* l = lo.data() + r * groups;
            float* h = hi.data() + r * groups;
            for (int64_t i = 0; i < in; ++i) {
              l[g_idx[i]] = std::min(l[g_idx[i]], row[i]);
              h[g_idx[i]] = std::max(h[g_idx[i]], row[i]);
            }
            for (int64_t k = 0; k < groups; ++k) {  // then the scale and zero
              const GroupScale gs = group_scale(l[k], h[k], bits, sym, min_zero);
              scale_f[static_cast<size_t>(r * groups + k)] = gs.scale;
              zero[static_cast<size_t>(r * groups + k)] = static_cast<uint8_t>(gs.zero);
              scales[static_cast<size_t>(k * out + o0 + r)] = float_to_f16(gs.scale);
              zeros[static_cast<size_t>(k * out + o0 + r)] = static_cast<uint8_t>(gs.zero);
            }
          }
          for (int64_t i = 0; i < in; ++i) {
            const int64_t k = g_idx[i];
            for (int64_t r = 0; r < n; ++r) {
              const size_t at = static_cast<size_t>(r * groups + k);
              const int v =
                  round_half_away(w[static_cast<size_t>(r * in + i)] / scale_f[at]) + zero[at];
              ints[static_cast<size_t>(i * out + o0 + r)] =
                  static_cast<uint8_t>(std::clamp(v, 0, maxq));
            }
          }
        }
      },
      /*serial_below=*/2);  // a block is ~a million weights: a thread each from two blocks on
  if (q.method == QuantMethod::kAwq) {
    parts.push_back({"qweight", DType::kI32, {in, out / 8}, as_bytes(pack_awq(ints, in, out))});
    parts.push_back({"qzeros", DType::kI32, {groups, out / 8}, as_bytes(pack_awq(zeros, groups, out))});
    parts.push_back({"scales", DType::kF16, {groups, out}, as_bytes(scales)});
    return parts;
  }
  const int64_t pack = q.pack_factor();
  if (q.zero_offset) {
    for (uint8_t& z : zeros) z = static_cast<uint8_t>(z - 1);
  }
  parts.push_back({"qweight", DType::kI32, {in / pack, out}, as_bytes(pack_rows(ints, in, out, bits))});
  parts.push_back({"qzeros", DType::kI32, {groups, out / pack},
                   as_bytes(pack_cols(zeros, groups, out, bits))});
  parts.push_back({"scales", DType::kF16, {groups, out}, as_bytes(scales)});
  parts.push_back({"g_idx", DType::kI32, {in}, as_bytes(g_idx)});
  return parts;
}

}  // namespace tessera
