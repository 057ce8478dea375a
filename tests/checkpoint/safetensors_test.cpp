#include "common/checkpoint/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>

#include "tests/checkpoint/test_util.h"

namespace tessera {
namespace {

using ckpt_test::TempDir;
using nlohmann::json;
using ::testing::HasSubstr;

std::vector<uint8_t> iota_bytes(size_t n, uint8_t start = 0) {
  std::vector<uint8_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

// A safetensors file with this header text and `data_bytes` bytes of data.
std::string raw_file(const std::string& header, size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\x5a');
}

// Opens `bytes` written to a file and returns the error it gives.
Status open_error(const TempDir& dir, const std::string& bytes,
                  const std::string& name = "model-00002-of-00004.safetensors") {
  ckpt_test::write_file(dir / name, bytes);
  Expected<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::open(dir / name);
  EXPECT_FALSE(f.has_value()) << "opened a corrupt file";
  Status st = f.status();
  EXPECT_THAT(st.message(), HasSubstr(name));
  return st;
}

TEST(SafetensorsTest, RoundTripAllDtypesAndLayout) {
  TempDir dir;
  const std::vector<float> f32 = {1.5f, -2.25f, 3.0f, 0.f, 1e-3f, 7.f};
  std::vector<uint16_t> bf16, f16;
  for (float v : f32) {
    bf16.push_back(float_to_bf16(v));
    f16.push_back(float_to_f16(v));
  }
  auto bytes_of = [](const auto& v) {
    return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()),
                                    v.size() * sizeof(v[0]));
  };
  const std::vector<uint8_t> odd = iota_bytes(6);  // 3 F16 elements: 6 bytes
  const std::vector<float> scalar = {42.f};        // borrowed: must outlive the write
  SafetensorsWriter w;
  ASSERT_TRUE(w.add("b.f16", DType::kF16, {2, 3}, bytes_of(f16)).is_ok());
  ASSERT_TRUE(w.add("a.odd", DType::kF16, {3}, odd).is_ok());
  ASSERT_TRUE(w.add("z.f32", DType::kF32, {3, 2}, bytes_of(f32)).is_ok());
  ASSERT_TRUE(w.add("m.bf16", DType::kBF16, {6}, bytes_of(bf16)).is_ok());
  ASSERT_TRUE(w.add("scalar", DType::kF32, {}, bytes_of(scalar)).is_ok());
  ASSERT_TRUE(w.add("empty", DType::kBF16, {0, 4}, {}).is_ok());
  EXPECT_EQ(w.size(), 6u);
  ASSERT_TRUE(w.write(dir / "t.safetensors").is_ok());
  EXPECT_FALSE(std::filesystem::exists(dir / "t.safetensors.tmp"));

  Expected<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::open(dir / "t.safetensors");
  ASSERT_TRUE(f.has_value()) << f.status().to_string();
  const SafetensorsFile& file = **f;
  EXPECT_EQ(file.data_offset() % 8, 0u);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  // The safetensors library's order: F32 first, then BF16, then F16; by name within a dtype.
  std::vector<std::string> order;
  for (const SafetensorsEntry& e : file.entries()) order.push_back(e.name);
  EXPECT_EQ(order,
            (std::vector<std::string>{"scalar", "z.f32", "empty", "m.bf16", "a.odd", "b.f16"}));

  Expected<TensorView> z = file.tensor("z.f32");
  ASSERT_TRUE(z.has_value());
  EXPECT_EQ(z->dtype, DType::kF32);
  EXPECT_EQ(z->shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(std::memcmp(z->data, f32.data(), 24), 0);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(z->data) % 4, 0u);
  Expected<TensorView> m = file.tensor("m.bf16");
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->dtype, DType::kBF16);
  EXPECT_FLOAT_EQ(m->at(1), -2.25f);
  Expected<TensorView> b = file.tensor("b.f16");
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->dtype, DType::kF16);
  EXPECT_FLOAT_EQ(b->at(2), 3.0f);
  EXPECT_EQ(std::memcmp(file.tensor("a.odd")->data, odd.data(), 6), 0);
  EXPECT_TRUE(file.tensor("scalar")->shape.empty());
  EXPECT_FLOAT_EQ(file.tensor("scalar")->at(0), 42.f);
  EXPECT_EQ(file.tensor("empty")->numel(), 0);
  // Views point into the mapping: zero-copy.
  EXPECT_EQ(file.tensor("z.f32")->data, z->data);
}

TEST(SafetensorsTest, HeaderIsWhatTheSafetensorsLibraryWrites) {
  TempDir dir;
  SafetensorsWriter w;
  std::vector<uint8_t> data = iota_bytes(8);
  ASSERT_TRUE(w.add("a", DType::kF32, {2}, data).is_ok());
  ASSERT_TRUE(w.write(dir / "a.safetensors").is_ok());
  const std::string bytes = ckpt_test::read_file(dir / "a.safetensors");
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string padded = header + std::string((8 - header.size() % 8) % 8, ' ');
  EXPECT_EQ(bytes, le64(padded.size()) + padded + std::string(data.begin(), data.end()));
}

TEST(SafetensorsTest, StreamsLargeTensorsInElementAlignedPieces) {
  TempDir dir;
  const int64_t n = 5'000'001;  // 20 MB of F32: more than one write buffer
  std::vector<std::pair<uint64_t, size_t>> calls;
  SafetensorsWriter w;
  ASSERT_TRUE(
      w.add(TensorSpec{"big", DType::kF32, {n}}, [&](uint64_t offset, std::span<uint8_t> out) {
         calls.emplace_back(offset, out.size());
         for (size_t i = 0; i < out.size() / 4; ++i) {
           float v = static_cast<float>(offset / 4 + i);
           std::memcpy(out.data() + 4 * i, &v, 4);
         }
         return Status::ok();
       }).is_ok());
  ASSERT_TRUE(w.write(dir / "big.safetensors").is_ok());
  ASSERT_GT(calls.size(), 1u);
  uint64_t expect = 0;
  for (auto [offset, size] : calls) {
    EXPECT_EQ(offset, expect);
    EXPECT_EQ(size % 4, 0u);
    expect += size;
  }
  EXPECT_EQ(expect, uint64_t(n) * 4);
  Expected<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::open(dir / "big.safetensors");
  ASSERT_TRUE(f.has_value());
  TensorView v = *(*f)->tensor("big");
  EXPECT_FLOAT_EQ(v.at(0), 0.f);
  EXPECT_FLOAT_EQ(v.at(n - 1), static_cast<float>(n - 1));
  EXPECT_FLOAT_EQ(v.at(4'194'304), 4'194'304.f);

  // A failing source aborts the write and names the tensor; nothing is left behind.
  SafetensorsWriter bad;
  ASSERT_TRUE(bad.add(TensorSpec{"broken", DType::kBF16, {4}},
                      [](uint64_t, std::span<uint8_t>) { return internal_error("disk on fire"); })
                  .is_ok());
  Status st = bad.write(dir / "bad.safetensors");
  EXPECT_THAT(st.message(), HasSubstr("'broken'"));
  EXPECT_THAT(st.message(), HasSubstr("disk on fire"));
  EXPECT_FALSE(std::filesystem::exists(dir / "bad.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir / "bad.safetensors.tmp"));
}

TEST(SafetensorsTest, WriterRefusesBadInput) {
  SafetensorsWriter w;
  std::vector<uint8_t> four = iota_bytes(4);
  ASSERT_TRUE(w.add("x", DType::kBF16, {2}, four).is_ok());
  EXPECT_THAT(w.add("x", DType::kBF16, {2}, four).message(), HasSubstr("twice"));
  EXPECT_THAT(w.add("__metadata__", DType::kBF16, {2}, four).message(), HasSubstr("reserved"));
  EXPECT_THAT(w.add("y", DType::kF32, {2}, four).message(), HasSubstr("needs 8 bytes, got 4"));
  EXPECT_THAT(w.add("z", DType::kF32, {-1}, four).message(), HasSubstr("negative"));
}

TEST(SafetensorsTest, ShardedRoundTripWithIndex) {
  TempDir dir;
  std::vector<std::vector<uint8_t>> data;
  SafetensorsWriter w;
  // 10 tensors of 1000 bytes plus one of 5000 (larger than a shard: alone in its own).
  for (int i = 0; i < 10; ++i) data.push_back(iota_bytes(1000, static_cast<uint8_t>(i)));
  data.push_back(iota_bytes(5000, 99));
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(
        w.add("layers." + std::to_string(i) + ".w", DType::kBF16, {10, 50}, data[i]).is_ok());
  }
  ASSERT_TRUE(w.add("lm_head", DType::kF32, {1250}, data[10]).is_ok());
  Expected<std::vector<std::string>> files = w.write_sharded(dir.path(), 3000);
  ASSERT_TRUE(files.has_value()) << files.status().to_string();
  // 3+3+3+1 of the small ones, and lm_head alone (appended when it is met, like huggingface_hub).
  ASSERT_EQ(files->size(), 6u);
  EXPECT_EQ(files->front(), "model-00001-of-00005.safetensors");
  EXPECT_EQ(files->back(), "model.safetensors.index.json");
  EXPECT_FALSE(std::filesystem::exists(dir / "model.safetensors"));

  json index = json::parse(ckpt_test::read_file(dir / "model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 15000);
  EXPECT_EQ(index["weight_map"]["layers.0.w"], "model-00001-of-00005.safetensors");
  EXPECT_EQ(index["weight_map"]["layers.9.w"], "model-00005-of-00005.safetensors");
  EXPECT_EQ(index["weight_map"]["lm_head"], "model-00004-of-00005.safetensors");

  Expected<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.has_value()) << ckpt.status().to_string();
  EXPECT_TRUE((*ckpt)->sharded());
  EXPECT_EQ((*ckpt)->size(), 11u);
  EXPECT_EQ((*ckpt)->files().size(), 5u);
  EXPECT_EQ((*ckpt)->total_bytes(), 15000u);
  for (int i = 0; i < 10; ++i) {
    const std::string name = "layers." + std::to_string(i) + ".w";
    Expected<TensorView> v = (*ckpt)->require(name, {10, 50});
    ASSERT_TRUE(v.has_value()) << v.status().to_string();
    EXPECT_EQ(std::memcmp(v->data, data[i].data(), 1000), 0) << name;
  }
  Expected<TensorView> head = (*ckpt)->tensor("lm_head");
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(std::memcmp(head->data, data[10].data(), 5000), 0);
  EXPECT_THAT((*ckpt)->file_of("lm_head")->path(), HasSubstr("model-00004-of-00005"));
  EXPECT_EQ((*ckpt)->names().front(), "layers.0.w");

  // Everything fits in one shard: a single model.safetensors and no index.
  TempDir one;
  files = w.write_sharded(one.path(), 1 << 20);
  ASSERT_TRUE(files.has_value());
  EXPECT_EQ(*files, std::vector<std::string>{"model.safetensors"});
  ckpt = Checkpoint::open(one.path());
  ASSERT_TRUE(ckpt.has_value());
  EXPECT_FALSE((*ckpt)->sharded());
  EXPECT_EQ((*ckpt)->size(), 11u);
}

TEST(SafetensorsTest, CheckpointLookupErrors) {
  TempDir dir;
  SafetensorsWriter w;
  std::vector<uint8_t> data = iota_bytes(64);
  for (const char* name :
       {"model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight", "model.norm.weight"}) {
    ASSERT_TRUE(w.add(name, DType::kBF16, {4, 8}, data).is_ok());
  }
  ASSERT_TRUE(w.write_sharded(dir.path(), 1 << 20).has_value());
  Expected<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.has_value());
  const Checkpoint& c = **ckpt;
  EXPECT_TRUE(c.has("model.norm.weight"));
  EXPECT_FALSE(c.has("model.norm.bias"));

  Status st = c.tensor("model.layers.0.mlp.up_proj.weights").status();
  EXPECT_EQ(st.code(), Code::kNotFound);
  EXPECT_THAT(st.message(), HasSubstr("'model.layers.0.mlp.up_proj.weights'"));
  EXPECT_THAT(st.message(), HasSubstr(dir.path()));
  EXPECT_THAT(st.message(), HasSubstr("similar names: 'model.layers.0.mlp.up_proj.weight'"));

  st = c.require("model.layers.1.mlp.up_proj.weight", {8, 4}).status();
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("model.safetensors: tensor 'model.layers.1.mlp.up_proj"));
  EXPECT_THAT(st.message(), HasSubstr("has shape [4, 8], expected [8, 4]"));

  Expected<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::open(dir / "model.safetensors");
  ASSERT_TRUE(f.has_value());
  st = (*f)->tensor("nope").status();
  EXPECT_EQ(st.code(), Code::kNotFound);
  EXPECT_THAT(st.message(), HasSubstr("model.safetensors: no tensor 'nope'"));
}

TEST(SafetensorsTest, CorruptFilesGiveErrorsNamingFileAndTensor) {
  TempDir dir;
  const std::string t = "model.layers.3.mlp.up_proj.weight";
  auto entry = [&](const std::string& dtype, const std::string& shape, uint64_t b, uint64_t e) {
    return "\"" + t + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
           std::to_string(b) + "," + std::to_string(e) + "]}";
  };
  // A good file, then truncated by 10 bytes.
  SafetensorsWriter w;
  std::vector<uint8_t> data = iota_bytes(64);
  ASSERT_TRUE(w.add(t, DType::kBF16, {4, 8}, data).is_ok());
  ASSERT_TRUE(w.write(dir / "good.safetensors").is_ok());
  std::string good = ckpt_test::read_file(dir / "good.safetensors");
  Status st = open_error(dir, good.substr(0, good.size() - 10));
  EXPECT_THAT(st.message(), HasSubstr("tensor '" + t + "': data_offsets [0, 64] run past the end"));

  st = open_error(dir, "abc");
  EXPECT_THAT(st.message(), HasSubstr("too short"));
  st = open_error(dir, le64(1000) + "{}");
  EXPECT_THAT(st.message(),
              HasSubstr("header length 1000 runs past the end of the file (10 bytes"));
  st = open_error(dir, le64(uint64_t(1) << 62) + std::string(64, ' '));
  EXPECT_THAT(st.message(), HasSubstr("over the 100000000-byte limit"));
  st = open_error(dir, raw_file("this is not json", 0));
  EXPECT_THAT(st.message(), HasSubstr("not a JSON object"));
  st = open_error(dir, raw_file("{\"a\": [1, 2,}", 0));
  EXPECT_THAT(st.message(), HasSubstr("not valid JSON"));
  st = open_error(dir, raw_file("{\"a\": 1e999}", 0));  // out of double's range
  EXPECT_THAT(st.message(), HasSubstr("not valid JSON"));
  st = open_error(dir, raw_file("{" + entry("BF16", "[4,8]", 0, 64) + "}", 40));
  EXPECT_THAT(st.message(), HasSubstr("tensor '" + t + "': data_offsets [0, 64] run past the end"));
  st = open_error(dir, raw_file("{" + entry("BF16", "[4,8]", 0, 60) + "}", 64));
  EXPECT_THAT(st.message(), HasSubstr("tensor '" + t +
                                      "': data_offsets [0, 60] span 60 bytes but shape [4, 8] "
                                      "of BF16 needs 64"));
  st = open_error(dir, raw_file("{" + entry("I64", "[4]", 0, 32) + "}", 32));
  EXPECT_THAT(st.message(), HasSubstr("tensor '" + t + "': dtype I64 is not supported"));
  st = open_error(dir, raw_file("{" + entry("Q4_K", "[4]", 0, 32) + "}", 32));
  EXPECT_THAT(st.message(), HasSubstr("dtype Q4_K"));
  st = open_error(dir, raw_file("{" + entry("F32", "[-4]", 0, 16) + "}", 16));
  EXPECT_THAT(st.message(), HasSubstr("tensor '" + t + "': shape [-4]"));
  st = open_error(dir, raw_file("{" + entry("F32", "[4]", 16, 0) + "}", 16));
  EXPECT_THAT(st.message(), HasSubstr("end before they begin"));
  st = open_error(dir, raw_file("{\"" + t + "\":{\"dtype\":\"F32\",\"shape\":[4]}}", 16));
  EXPECT_THAT(st.message(), HasSubstr("tensor '" + t + "': missing \"data_offsets\""));
  st = open_error(dir, raw_file(R"({"__metadata__":{"format":1}})", 0));
  EXPECT_THAT(st.message(), HasSubstr("__metadata__['format']"));
  const std::string overlap = "{" + entry("F32", "[4]", 0, 16) +
                              R"(,"model.layers.3.mlp.down_proj.weight":)"
                              R"({"dtype":"F32","shape":[4],"data_offsets":[8,24]}})";
  st = open_error(dir, raw_file(overlap, 24));
  EXPECT_THAT(st.message(), HasSubstr("tensor 'model.layers.3.mlp.down_proj.weight' data_offsets "
                                      "[8, 24] overlap tensor '" +
                                      t + "' [0, 16]"));
  // Gaps and trailing bytes are tolerated; empty tensors may share an offset.
  ckpt_test::write_file(
      dir / "gap.safetensors",
      raw_file("{" + entry("F32", "[2]", 8, 16) +
                   R"(,"e1":{"dtype":"F32","shape":[0],"data_offsets":[8,8]})" +
                   R"(,"e2":{"dtype":"BF16","shape":[0,3],"data_offsets":[8,8]}})",
               32));
  EXPECT_TRUE(SafetensorsFile::open(dir / "gap.safetensors").has_value());
  EXPECT_EQ(SafetensorsFile::open(dir / "absent.safetensors").status().code(), Code::kNotFound);
}

// Inputs the fuzzer (tests/fuzz/safetensors_fuzz.cpp) once crashed on, and the bytes-level
// parser it drives.
TEST(SafetensorsTest, HeaderParsedFromBytes) {
  auto bytes = [](const std::string& s) {
    return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  };
  const std::string file = raw_file(
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F16","shape":[2],"data_offsets":[8,12]},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
      12);
  Expected<SafetensorsHeader> h = parse_safetensors_header(bytes(file), "m.safetensors");
  ASSERT_TRUE(h.has_value()) << h.status().to_string();
  EXPECT_EQ(h->data_offset, file.size() - 12);
  ASSERT_EQ(h->entries.size(), 2u);
  EXPECT_EQ(h->entries[0].name, "a");  // ordered by offset
  EXPECT_EQ(h->entries[1].name, "b");
  EXPECT_EQ(h->metadata.at("format"), "pt");

  // A number too large for a double is a JSON error, not an escaping exception.
  Status st =
      parse_safetensors_header(bytes(raw_file(R"({"a":{"dtype":1E400}})", 0)), "m.safetensors")
          .status();
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("m.safetensors: header is not valid JSON"));
  EXPECT_THAT(st.message(), HasSubstr("number overflow"));
  st = parse_safetensors_header(bytes("1234567"), "m.safetensors").status();
  EXPECT_THAT(st.message(), HasSubstr("m.safetensors: file is 7 bytes, too short"));
}

TEST(SafetensorsTest, CorruptShardedSetsNameShardAndTensor) {
  TempDir src;
  SafetensorsWriter w;
  std::vector<uint8_t> data = iota_bytes(100);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(
        w.add("model.layers." + std::to_string(i) + ".w", DType::kBF16, {50}, data).is_ok());
  }
  ASSERT_TRUE(w.write_sharded(src.path(), 200).has_value());  // 2 shards of 2 tensors
  namespace fs = std::filesystem;
  auto copy_set = [&](const TempDir& to) {
    for (const auto& e : fs::directory_iterator(src.path())) {
      fs::copy_file(e.path(), fs::path(to.path()) / e.path().filename());
    }
  };

  {  // A shard file is missing.
    TempDir d;
    copy_set(d);
    fs::remove(d / "model-00002-of-00002.safetensors");
    Status st = Checkpoint::open(d.path()).status();
    EXPECT_EQ(st.code(), Code::kNotFound);
    EXPECT_THAT(st.message(), HasSubstr("shard 'model-00002-of-00002.safetensors'"));
    EXPECT_THAT(st.message(), HasSubstr("'model.layers.2.w'"));
    EXPECT_THAT(st.message(), HasSubstr("does not exist"));
  }
  {  // The index lists a tensor its shard does not hold.
    TempDir d;
    copy_set(d);
    json index = json::parse(ckpt_test::read_file(d / "model.safetensors.index.json"));
    index["weight_map"]["model.layers.9.w"] = "model-00001-of-00002.safetensors";
    ckpt_test::write_file(d / "model.safetensors.index.json", index.dump());
    Status st = Checkpoint::open(d.path()).status();
    EXPECT_THAT(st.message(), HasSubstr("model-00001-of-00002.safetensors: tensor "
                                        "'model.layers.9.w' is listed in"));
    EXPECT_THAT(st.message(), HasSubstr("does not contain it"));
  }
  {  // A shard is corrupt: its own error, naming it.
    TempDir d;
    copy_set(d);
    std::string shard = ckpt_test::read_file(d / "model-00001-of-00002.safetensors");
    ckpt_test::write_file(d / "model-00001-of-00002.safetensors",
                          shard.substr(0, shard.size() - 1));
    Status st = Checkpoint::open(d.path()).status();
    EXPECT_THAT(st.message(), HasSubstr("model-00001-of-00002.safetensors: tensor "
                                        "'model.layers.1.w'"));
  }
  {  // Index entries must be plain file names; the index must be JSON with a weight_map.
    TempDir d;
    copy_set(d);
    ckpt_test::write_file(d / "model.safetensors.index.json",
                          R"({"weight_map": {"x": "../model-00001-of-00002.safetensors"}})");
    EXPECT_THAT(Checkpoint::open(d.path()).status().message(), HasSubstr("not a plain file name"));
    ckpt_test::write_file(d / "model.safetensors.index.json", R"({"metadata": {}})");
    EXPECT_THAT(Checkpoint::open(d.path()).status().message(), HasSubstr("weight_map"));
    ckpt_test::write_file(d / "model.safetensors.index.json", "{oops");
    EXPECT_THAT(Checkpoint::open(d.path()).status().message(),
                HasSubstr("model.safetensors.index.json: not valid JSON"));
  }
  {  // Neither file; a PyTorch checkpoint gets a hint.
    TempDir d;
    Status st = Checkpoint::open(d.path()).status();
    EXPECT_EQ(st.code(), Code::kNotFound);
    EXPECT_THAT(st.message(), HasSubstr("neither model.safetensors nor"));
    ckpt_test::write_file(d / "pytorch_model.bin", "pickle");
    EXPECT_THAT(Checkpoint::open(d.path()).status().message(), HasSubstr("pytorch_model.bin"));
    EXPECT_EQ(Checkpoint::open(d / "nowhere").status().code(), Code::kNotFound);
  }
}

}  // namespace
}  // namespace tessera
