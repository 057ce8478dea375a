#include "common/shm_ring.h"

#include <gtest/gtest.h>

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include "tests/common/fork_child.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace tessera {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;
using testing::Child;
using testing::unique_name;

// Message #seq: a length in 0..max_bytes that varies with seq, and bytes derived from both.
std::vector<std::byte> make_message(uint64_t seq, size_t max_bytes) {
  size_t length = (seq * 7919 + 13) % (max_bytes + 1);
  std::vector<std::byte> msg(length);
  for (size_t j = 0; j < length; ++j)
    msg[j] = static_cast<std::byte>((seq * 31 + j * 7 + (j >> 8)) & 0xff);
  return msg;
}

// Empty if `got` is message #seq, else a description of the difference.
std::string check_message(uint64_t seq, size_t max_bytes, std::span<const std::byte> got) {
  std::vector<std::byte> want = make_message(seq, max_bytes);
  if (got.size() != want.size()) {
    return "message #" + std::to_string(seq) + " has " + std::to_string(got.size()) +
           " bytes, expected " + std::to_string(want.size());
  }
  for (size_t j = 0; j < want.size(); ++j) {
    if (got[j] != want[j])
      return "message #" + std::to_string(seq) + " differs at byte " + std::to_string(j);
  }
  return "";
}

// Reads `count` messages as reader `index` of ring `name` (opened by name, as an actor would),
// checking each, then expects the end of the ring. Returns "" or what went wrong.
std::string read_all(const std::string& name, uint32_t index, uint64_t count, size_t slot_bytes,
                     std::chrono::microseconds pause) {
  auto ring = ShmRing::open(name);
  if (!ring) return ring.status().to_string();
  ring->segment().release_ownership();
  auto reader = ring->reader(index);
  if (!reader) return reader.status().to_string();
  std::vector<std::byte> buf(slot_bytes);
  for (uint64_t seq = 0; seq < count; ++seq) {
    auto n = reader->read(buf, milliseconds(10000));
    if (!n) return "reader " + std::to_string(index) + ": " + n.status().to_string();
    std::string err = check_message(seq, slot_bytes, std::span(buf.data(), *n));
    if (!err.empty()) return "reader " + std::to_string(index) + ": " + err;
    if (pause.count() > 0) std::this_thread::sleep_for(pause);  // being slow, not synchronizing
  }
  auto end = reader->read(buf, milliseconds(10000));
  if (end.status().code() != Code::kUnavailable) {
    return "reader " + std::to_string(index) + " expected the ring closed, got " +
           (end ? "a message" : end.status().to_string());
  }
  return "";
}

Status write_message(RingWriter& writer, uint64_t seq, milliseconds timeout = milliseconds(10000)) {
  std::vector<std::byte> msg = make_message(seq, writer.slot_bytes());
  return writer.write(msg, timeout);
}

// An aligned heap region, for tests that poke at the raw layout.
struct Region {
  explicit Region(size_t n) : bytes(n), mem(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096)) {
    std::memset(mem, 0, n);
  }
  ~Region() { std::free(mem); }
  size_t bytes;
  void* mem;
};

TEST(ShmRingTest, LayoutRejectsBadGeometry) {
  EXPECT_TRUE(BroadcastRing::layout_bytes(64, 4, 2).has_value());
  EXPECT_EQ(BroadcastRing::layout_bytes(0, 4, 2).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(BroadcastRing::layout_bytes(64, 0, 2).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(BroadcastRing::layout_bytes(64, 4, 0).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(BroadcastRing::layout_bytes(BroadcastRing::kMaxSlotBytes + 1, 4, 2).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(BroadcastRing::layout_bytes(64, BroadcastRing::kMaxSlots + 1, 2).status().code(),
            Code::kInvalidArgument);
  Region small(1024);
  EXPECT_EQ(BroadcastRing::format(small.mem, small.bytes, 64, 4, 2).code(), Code::kInvalidArgument);
}

TEST(ShmRingTest, RoundTripInOneProcess) {
  auto ring = ShmRing::create(unique_name("roundtrip"), 100, 4, 1);
  ASSERT_TRUE(ring.has_value()) << ring.status().to_string();
  auto writer = ring->writer();
  auto reader = ring->reader(0);
  ASSERT_TRUE(writer.has_value()) << writer.status().to_string();
  ASSERT_TRUE(reader.has_value()) << reader.status().to_string();
  const std::string hello = "hello";
  ASSERT_TRUE(writer->write(std::as_bytes(std::span(hello)), milliseconds(0)).is_ok());
  ASSERT_TRUE(writer->write({}, milliseconds(0)).is_ok());  // empty messages are messages too
  auto first = reader->read(milliseconds(0));
  ASSERT_TRUE(first.has_value()) << first.status().to_string();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(first->data()), first->size()), hello);
  auto second = reader->read(milliseconds(0));
  ASSERT_TRUE(second.has_value());
  EXPECT_TRUE(second->empty());
  EXPECT_EQ(reader->position(), 2u);
  RingStats stats = writer->stats();
  EXPECT_EQ(stats.written, 2u);
  ASSERT_EQ(stats.read.size(), 1u);
  EXPECT_EQ(stats.read[0], 2u);
  EXPECT_FALSE(stats.closed);
}

TEST(ShmRingTest, OversizeMessageIsRejected) {
  auto ring = ShmRing::create(unique_name("oversize"), 100, 4, 1);
  ASSERT_TRUE(ring.has_value());
  auto writer = ring->writer();
  ASSERT_TRUE(writer.has_value());
  std::vector<std::byte> big(101);
  Status st = writer->write(big, milliseconds(0));
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("101 bytes"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("100 bytes"), std::string::npos) << st.message();
  EXPECT_EQ(writer->written(), 0u);
  std::vector<std::byte> exact(100);
  EXPECT_TRUE(writer->write(exact, milliseconds(0)).is_ok());
}

TEST(ShmRingTest, ShortBufferDoesNotConsume) {
  auto ring = ShmRing::create(unique_name("short"), 100, 4, 1);
  ASSERT_TRUE(ring.has_value());
  auto writer = ring->writer();
  auto reader = ring->reader(0);
  ASSERT_TRUE(writer.has_value() && reader.has_value());
  std::vector<std::byte> msg(80, std::byte{7});
  ASSERT_TRUE(writer->write(msg, milliseconds(0)).is_ok());
  std::vector<std::byte> small(10);
  auto n = reader->read(small, milliseconds(0));
  EXPECT_EQ(n.status().code(), Code::kInvalidArgument);
  EXPECT_NE(n.status().message().find("80 bytes"), std::string::npos) << n.status().message();
  EXPECT_EQ(reader->position(), 0u);
  std::vector<std::byte> big(100);
  n = reader->read(big, milliseconds(0));
  ASSERT_TRUE(n.has_value());
  EXPECT_EQ(*n, 80u);
}

TEST(ShmRingTest, WrapAroundKeepsOrderAndContent) {
  constexpr size_t kSlotBytes = 300;
  constexpr uint64_t kMessages = 5000;  // 1250 times round 4 slots
  auto ring = ShmRing::create(unique_name("wrap"), kSlotBytes, 4, 1);
  ASSERT_TRUE(ring.has_value());
  auto writer = ring->writer();
  auto reader = ring->reader(0);
  ASSERT_TRUE(writer.has_value() && reader.has_value());
  Status write_status;
  std::thread producer([&] {
    for (uint64_t seq = 0; seq < kMessages && write_status.is_ok(); ++seq) {
      write_status = write_message(*writer, seq);
    }
    writer->close();
  });
  std::string error;
  for (uint64_t seq = 0; seq < kMessages && error.empty(); ++seq) {
    auto msg = reader->read(milliseconds(10000));
    error = msg ? check_message(seq, kSlotBytes, *msg) : msg.status().to_string();
  }
  producer.join();
  EXPECT_EQ(error, "");
  EXPECT_TRUE(write_status.is_ok()) << write_status.to_string();
  EXPECT_EQ(reader->read(milliseconds(1000)).status().code(), Code::kUnavailable);
}

TEST(ShmRingTest, ReadersInSeparateProcessesGetEveryMessage) {
  constexpr size_t kSlotBytes = 512;
  constexpr uint32_t kReaders = 3;
  constexpr uint64_t kMessages = 2000;
  std::string name = unique_name("procs");
  auto ring = ShmRing::create(name, kSlotBytes, 8, kReaders);
  ASSERT_TRUE(ring.has_value()) << ring.status().to_string();
  std::vector<std::unique_ptr<Child>> children;
  for (uint32_t i = 0; i < kReaders; ++i) {
    children.push_back(std::make_unique<Child>(
        [&, i] { return read_all(name, i, kMessages, kSlotBytes, std::chrono::microseconds(0)); }));
  }
  auto writer = ring->writer();
  ASSERT_TRUE(writer.has_value());
  for (uint64_t seq = 0; seq < kMessages; ++seq) {
    Status st = write_message(*writer, seq);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  writer->close();
  for (uint32_t i = 0; i < kReaders; ++i) {
    EXPECT_EQ(children[i]->wait(milliseconds(20000)), "") << "reader " << i;
  }
  RingStats stats = writer->stats();
  for (uint32_t i = 0; i < kReaders; ++i) EXPECT_EQ(stats.read[i], kMessages);
}

TEST(ShmRingTest, SlowReaderBlocksTheWriterAndLosesNothing) {
  constexpr size_t kSlotBytes = 256;
  constexpr size_t kSlots = 4;
  constexpr uint64_t kMessages = 200;
  std::string name = unique_name("slow");
  auto ring = ShmRing::create(name, kSlotBytes, kSlots, 2);
  ASSERT_TRUE(ring.has_value());
  Child fast(
      [&] { return read_all(name, 0, kMessages, kSlotBytes, std::chrono::microseconds(0)); });
  Child slow(
      [&] { return read_all(name, 1, kMessages, kSlotBytes, std::chrono::microseconds(500)); });
  auto writer = ring->writer();
  ASSERT_TRUE(writer.has_value());
  uint64_t max_backlog = 0;
  for (uint64_t seq = 0; seq < kMessages; ++seq) {
    Status st = write_message(*writer, seq);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    RingStats stats = writer->stats();
    for (uint64_t read : stats.read) max_backlog = std::max(max_backlog, stats.written - read);
  }
  writer->close();
  EXPECT_EQ(fast.wait(milliseconds(20000)), "");
  EXPECT_EQ(slow.wait(milliseconds(20000)), "");
  // The writer ran ahead until the ring was full, never further.
  EXPECT_EQ(max_backlog, kSlots);
}

TEST(ShmRingTest, WriterTimesOutNamingTheReaderThatStopped) {
  auto ring = ShmRing::create(unique_name("stuck"), 64, 4, 2);
  ASSERT_TRUE(ring.has_value());
  auto writer = ring->writer();
  auto stuck = ring->reader(0);
  auto live = ring->reader(1);
  ASSERT_TRUE(writer.has_value() && stuck.has_value() && live.has_value());
  for (uint64_t seq = 0; seq < 4; ++seq) {
    ASSERT_TRUE(write_message(*writer, seq, milliseconds(0)).is_ok());
    ASSERT_TRUE(live->read(milliseconds(0)).has_value());
  }
  auto start = Clock::now();
  Status st = write_message(*writer, 4, milliseconds(50));
  EXPECT_GE(Clock::now() - start, milliseconds(50));
  EXPECT_EQ(st.code(), Code::kDeadlineExceeded);
  EXPECT_NE(st.message().find("reader 0 is 4 messages behind"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("has not advanced for"), std::string::npos) << st.message();
  EXPECT_EQ(st.message().find("reader 1"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find(ring->segment().name()), std::string::npos) << st.message();
  EXPECT_EQ(writer->written(), 4u);
  // Once the stuck reader moves, the write goes through.
  ASSERT_TRUE(stuck->read(milliseconds(0)).has_value());
  EXPECT_TRUE(write_message(*writer, 4, milliseconds(0)).is_ok());
}

TEST(ShmRingTest, ReaderTimesOutWhenNothingIsWritten) {
  auto ring = ShmRing::create(unique_name("empty"), 64, 4, 1);
  ASSERT_TRUE(ring.has_value());
  auto reader = ring->reader(0);
  ASSERT_TRUE(reader.has_value());
  EXPECT_EQ(reader->read(milliseconds(0)).status().code(), Code::kDeadlineExceeded);
  auto start = Clock::now();
  auto msg = reader->read(milliseconds(30));
  EXPECT_GE(Clock::now() - start, milliseconds(30));
  EXPECT_EQ(msg.status().code(), Code::kDeadlineExceeded);
  EXPECT_NE(msg.status().message().find("reader 0 waited"), std::string::npos)
      << msg.status().message();
  EXPECT_NE(msg.status().message().find("message #0"), std::string::npos) << msg.status().message();
}

TEST(ShmRingTest, CloseDrainsThenReportsTheEnd) {
  auto ring = ShmRing::create(unique_name("close"), 64, 4, 2);
  ASSERT_TRUE(ring.has_value());
  auto writer = ring->writer();
  auto reader = ring->reader(0);
  ASSERT_TRUE(writer.has_value() && reader.has_value());
  for (uint64_t seq = 0; seq < 3; ++seq)
    ASSERT_TRUE(write_message(*writer, seq, milliseconds(0)).is_ok());
  writer->close();
  writer->close();  // idempotent
  EXPECT_TRUE(writer->stats().closed);
  EXPECT_EQ(write_message(*writer, 3, milliseconds(0)).code(), Code::kFailedPrecondition);
  for (uint64_t seq = 0; seq < 3; ++seq) {
    auto msg = reader->read(milliseconds(0));
    ASSERT_TRUE(msg.has_value()) << msg.status().to_string();
    EXPECT_EQ(check_message(seq, 64, *msg), "");
  }
  for (int i = 0; i < 2; ++i) {
    auto end = reader->read(milliseconds(1000));
    EXPECT_EQ(end.status().code(), Code::kUnavailable);
    EXPECT_NE(end.status().message().find("closed"), std::string::npos) << end.status().message();
  }
}

TEST(ShmRingTest, CloseWakesABlockedReader) {
  auto ring = ShmRing::create(unique_name("closewake"), 64, 4, 1);
  ASSERT_TRUE(ring.has_value());
  auto writer = ring->writer();
  auto reader = ring->reader(0);
  ASSERT_TRUE(writer.has_value() && reader.has_value());
  Status result;
  auto start = Clock::now();
  std::thread blocked([&] { result = reader->read(milliseconds(20000)).status(); });
  writer->close();
  blocked.join();
  EXPECT_EQ(result.code(), Code::kUnavailable) << result.to_string();
  EXPECT_LT(Clock::now() - start, milliseconds(5000));
}

// A reader told when its message should come (read's poll_from) gets it whether it comes long
// before then (the futex sleep until poll_from still wakes on it), within the polling window,
// or long after it (the reader sleeps again once its polling ends); a poll_from long past is a
// plain read. Each message is read intact, and none waits for its poll_from.
TEST(ShmRingTest, AReaderToldWhenToPollGetsEveryMessageOnTime) {
  auto ring = ShmRing::create(unique_name("pollfrom"), 64, 4, 1);
  ASSERT_TRUE(ring.has_value());
  auto writer = ring->writer();
  auto reader = ring->reader(0);
  ASSERT_TRUE(writer.has_value() && reader.has_value());
  struct Case {
    milliseconds poll_in;   // poll_from, from the read's start (negative: in the past)
    milliseconds write_in;  // when the message is written
  };
  const Case cases[] = {{milliseconds(3000), milliseconds(20)},
                        {milliseconds(30), milliseconds(31)},
                        {milliseconds(10), milliseconds(60)},
                        {milliseconds(-5000), milliseconds(20)}};
  uint64_t seq = 0;
  for (const Case& c : cases) {
    std::vector<std::byte> buf(writer->slot_bytes());
    Expected<size_t> got = Status::ok();
    const auto start = Clock::now();
    std::thread r([&] { got = reader->read(buf, milliseconds(20000), start + c.poll_in); });
    std::this_thread::sleep_until(start + c.write_in);
    ASSERT_TRUE(write_message(*writer, seq).is_ok());
    r.join();
    const auto took = Clock::now() - start;
    ASSERT_TRUE(got.has_value()) << got.status().to_string();
    EXPECT_EQ(check_message(seq, writer->slot_bytes(), std::span(buf.data(), *got)), "");
    // Long before poll_from: woken by the message, not by the clock (3 s away).
    EXPECT_LT(took, c.write_in + milliseconds(1500)) << "case " << seq;
    ++seq;
  }
}

TEST(ShmRingTest, ReaderResumesFromItsCursor) {
  auto ring = ShmRing::create(unique_name("resume"), 64, 4, 1);
  ASSERT_TRUE(ring.has_value());
  auto writer = ring->writer();
  ASSERT_TRUE(writer.has_value());
  for (uint64_t seq = 0; seq < 3; ++seq)
    ASSERT_TRUE(write_message(*writer, seq, milliseconds(0)).is_ok());
  {
    auto reader = ring->reader(0);
    ASSERT_TRUE(reader.has_value());
    ASSERT_TRUE(reader->read(milliseconds(0)).has_value());
  }
  auto again = ring->reader(0);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->position(), 1u);
  auto msg = again->read(milliseconds(0));
  ASSERT_TRUE(msg.has_value());
  EXPECT_EQ(check_message(1, 64, *msg), "");
}

TEST(ShmRingTest, CorruptHeaderIsRejectedOnAttach) {
  const size_t bytes = *BroadcastRing::layout_bytes(64, 4, 2);
  Region region(bytes);
  auto* words = static_cast<uint64_t*>(region.mem);  // the header starts with magic, version
  auto reformat = [&] { ASSERT_TRUE(BroadcastRing::format(region.mem, bytes, 64, 4, 2).is_ok()); };

  // Never formatted.
  EXPECT_EQ(RingWriter::attach(region.mem, bytes).status().code(), Code::kFailedPrecondition);
  reformat();
  EXPECT_TRUE(RingWriter::attach(region.mem, bytes).has_value());
  EXPECT_TRUE(RingReader::attach(region.mem, bytes, 1).has_value());
  EXPECT_EQ(RingReader::attach(region.mem, bytes, 2).status().code(), Code::kInvalidArgument);
  // A mapping shorter than the ring claims.
  Status st = RingWriter::attach(region.mem, bytes - 1).status();
  EXPECT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(st.message().find("mapped"), std::string::npos) << st.message();
  EXPECT_EQ(RingWriter::attach(region.mem, 100).status().code(), Code::kFailedPrecondition);
  // Unaligned memory.
  EXPECT_EQ(RingWriter::attach(static_cast<char*>(region.mem) + 8, bytes - 8).status().code(),
            Code::kInvalidArgument);
  // Bad magic.
  words[0] ^= 1;
  st = RingReader::attach(region.mem, bytes, 0).status();
  EXPECT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(st.message().find("magic"), std::string::npos) << st.message();
  // Another layout version (the u32 after the magic).
  reformat();
  reinterpret_cast<uint32_t*>(words)[2] = 99;
  st = RingReader::attach(region.mem, bytes, 0).status();
  EXPECT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(st.message().find("version 99"), std::string::npos) << st.message();
  // Absurd geometry: readers, then slot count.
  reformat();
  reinterpret_cast<uint32_t*>(words)[3] = 1u << 30;
  EXPECT_EQ(RingReader::attach(region.mem, bytes, 0).status().code(), Code::kFailedPrecondition);
  reformat();
  words[3] = 1ull << 40;  // slots (after slot_bytes)
  st = RingWriter::attach(region.mem, bytes).status();
  EXPECT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(st.message().find("corrupt"), std::string::npos) << st.message();
  // A plausible but different geometry that no longer matches the recorded sizes.
  reformat();
  words[3] = 3;
  EXPECT_EQ(RingWriter::attach(region.mem, bytes).status().code(), Code::kFailedPrecondition);
}

TEST(ShmRingTest, CorruptSlotLengthIsAnErrorNotACrash) {
  const size_t bytes = *BroadcastRing::layout_bytes(64, 4, 1);
  Region region(bytes);
  ASSERT_TRUE(BroadcastRing::format(region.mem, bytes, 64, 4, 1).is_ok());
  auto writer = RingWriter::attach(region.mem, bytes, "test ring");
  auto reader = RingReader::attach(region.mem, bytes, 0, "test ring");
  ASSERT_TRUE(writer.has_value() && reader.has_value());
  std::vector<std::byte> msg(10);
  ASSERT_TRUE(writer->write(msg, milliseconds(0)).is_ok());
  // The slots end the region: 4 of {u32 length, u32, 64 bytes}, each padded to 128 bytes.
  const size_t slot0 = bytes - 4 * 128;
  *reinterpret_cast<uint32_t*>(static_cast<char*>(region.mem) + slot0) = 1u << 20;
  std::vector<std::byte> out(1 << 21);
  auto n = reader->read(out, milliseconds(0));
  EXPECT_EQ(n.status().code(), Code::kInternal);
  EXPECT_NE(n.status().message().find("test ring: corrupt"), std::string::npos)
      << n.status().message();
  EXPECT_EQ(reader->read(milliseconds(0)).status().code(), Code::kInternal);
}

TEST(ShmRingTest, OpenRejectsSegmentsThatAreNotRings) {
  std::string name = unique_name("notring");
  auto seg = ShmSegment::create(name, 4096);
  ASSERT_TRUE(seg.has_value());
  auto ring = ShmRing::open(name);
  EXPECT_EQ(ring.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(ring.status().message().find(name), std::string::npos) << ring.status().message();
  EXPECT_EQ(ShmRing::open(unique_name("absent")).status().code(), Code::kNotFound);
}

}  // namespace
}  // namespace tessera
