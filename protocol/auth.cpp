#include "protocol/auth.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/session.h"
#include "common/sha256.h"

namespace tessera::auth {

namespace {

// Length-prefixed fields, so no two different field lists hash alike.
void add_field(std::string& out, const std::string& field) {
  uint32_t n = static_cast<uint32_t>(field.size());
  for (int i = 0; i < 4; ++i) out += static_cast<char>((n >> (8 * i)) & 0xff);
  out += field;
}

}  // namespace

Expected<std::string> make_secret() {
  TESSERA_ASSIGN_OR_RETURN(std::string raw, random_bytes(32));
  return to_hex(raw);
}

Expected<std::string> make_nonce() { return random_bytes(kNonceBytes); }

std::string server_proof(const std::string& secret, proto::Role role, const std::string& server_id,
                         const std::string& client_nonce, const std::string& server_nonce) {
  std::string msg;
  add_field(msg, "tessera-server");
  add_field(msg, std::to_string(static_cast<int>(role)));
  add_field(msg, server_id);
  add_field(msg, client_nonce);
  add_field(msg, server_nonce);
  return digest_bytes(hmac_sha256(secret, msg));
}

std::string client_proof(const std::string& secret, const std::string& peer,
                         const std::string& server_nonce, const std::string& client_nonce) {
  std::string msg;
  add_field(msg, "tessera-client");
  add_field(msg, peer);
  add_field(msg, server_nonce);
  add_field(msg, client_nonce);
  return digest_bytes(hmac_sha256(secret, msg));
}

Expected<std::string> check_secret(std::string text, const std::string& origin) {
  auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!text.empty() && space(text.back())) text.pop_back();
  size_t lead = 0;
  while (lead < text.size() && space(text[lead])) ++lead;
  text.erase(0, lead);
  if (text.size() < kMinSecretLength || text.size() > kMaxSecretLength) {
    return invalid_argument(
        "the cluster token from " + origin + " has " + std::to_string(text.size()) +
        " characters; a token has " + std::to_string(kMinSecretLength) + " to " +
        std::to_string(kMaxSecretLength) + " (`tessera start --head` makes a strong one of 64)");
  }
  for (char c : text) {
    if (static_cast<unsigned char>(c) < 0x21 || static_cast<unsigned char>(c) > 0x7e) {
      return invalid_argument("the cluster token from " + origin +
                              " must be printable ASCII without spaces");
    }
  }
  return text;
}

Expected<std::string> read_token_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return not_found("cannot read the cluster token file " + path + ": " + std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument("the cluster token file " + path + " is not a regular file");
  }
  if (st.st_uid != ::geteuid()) {
    ::close(fd);
    return Status(Code::kPermissionDenied, "the cluster token file " + path + " belongs to uid " +
                                               std::to_string(st.st_uid) +
                                               ", not to this user; copy it and chmod 600 it");
  }
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    ::close(fd);
    return Status(Code::kPermissionDenied, "the cluster token file " + path +
                                               " may be read by other users; chmod 600 " + path);
  }
  // A token and a little white space around it; anything bigger is refused whole, never cut
  // (a cut token would let another file with the same start pass).
  constexpr size_t kMaxFileBytes = 4 * kMaxSecretLength;
  auto too_big = [&](uint64_t bytes) {
    return invalid_argument("the cluster token file " + path + " has " + std::to_string(bytes) +
                            " bytes; a token has " + std::to_string(kMinSecretLength) + " to " +
                            std::to_string(kMaxSecretLength) +
                            " characters (`tessera start --head` makes a strong one of 64)");
  };
  if (static_cast<uint64_t>(st.st_size) > kMaxFileBytes) {
    ::close(fd);
    return too_big(static_cast<uint64_t>(st.st_size));
  }
  std::string text;
  char buf[512];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) != 0) {
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return unavailable("cannot read the cluster token file " + path + ": " + std::strerror(err));
    }
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > kMaxFileBytes) {  // it grew while being read
      ::close(fd);
      return too_big(text.size());
    }
  }
  ::close(fd);
  return check_secret(std::move(text), path);
}

Expected<std::string> resolve_cluster_token(const std::string& flag_file, const std::string& root) {
  if (!flag_file.empty()) return read_token_file(flag_file);
  const char* env = std::getenv(kTokenEnv);
  if (env != nullptr && *env != '\0') return check_secret(env, std::string("$") + kTokenEnv);
  if (!root.empty()) {
    std::string path = cluster_token_path(root);
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0) return read_token_file(path);
  }
  return not_found(
      "no cluster token: pass --cluster-token-file PATH or set TESSERA_CLUSTER_TOKEN (the head "
      "printed where its token is when it started; on the head's machine it is " +
      (root.empty() ? std::string("<temp root>/cluster_token") : cluster_token_path(root)) + ")");
}

}  // namespace tessera::auth
