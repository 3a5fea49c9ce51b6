#include "io/file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>
#include <system_error>

#include "detlogp/error.hpp"

namespace detlogp::io {

namespace fs = std::filesystem;

namespace {

// What stat() says about `path` as the reason it cannot be read, or "" for a regular file.
std::string unreadable_reason(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    return err == ENOENT || err == ENOTDIR ? "no such file" : std::strerror(err);
  }
  if (S_ISDIR(st.st_mode)) return "it is a directory";
  if (!S_ISREG(st.st_mode)) return "not a regular file";
  return "";
}

// Closes a descriptor on every path out of the constructor.
struct FileDescriptor {
  int fd = -1;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

void check_input_file(const fs::path& path) {
  const std::string reason = unreadable_reason(path);
  DETLOGP_CHECK(reason.empty(), "cannot read '" << path.string() << "': " << reason);
}

MappedFile::MappedFile(const fs::path& path) : path_(path) {
  check_input_file(path);
  FileDescriptor file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (file.fd < 0) {
    const int err = errno;
    DETLOGP_FAIL("cannot open '" << path.string() << "' for reading: " << std::strerror(err));
  }
  struct stat st {};
  if (::fstat(file.fd, &st) != 0) {
    const int err = errno;
    DETLOGP_FAIL("cannot read '" << path.string() << "': " << std::strerror(err));
  }
  DETLOGP_CHECK(S_ISREG(st.st_mode), "cannot read '" << path.string() << "': not a regular file");
  size_ = static_cast<size_t>(st.st_size);
  if (size_ == 0) return;
  void* base = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, file.fd, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    DETLOGP_FAIL("cannot map '" << path.string() << "' (" << size_ << " bytes) for reading: " << std::strerror(err));
  }
  base_ = base;
}

MappedFile::~MappedFile() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

namespace {

// Throws unless the nearest ancestor of `path` that exists is a directory (or none exists up to
// the root): only then can the missing ones below it be made. `what` begins the message.
void check_nearest_existing_ancestor(const fs::path& path, const std::string& what) {
  std::error_code ec;
  for (fs::path dir = path.parent_path();; dir = dir.parent_path()) {
    if (dir.empty()) dir = ".";
    const fs::file_status st = fs::status(dir, ec);
    if (fs::exists(st)) {
      DETLOGP_CHECK(fs::is_directory(st), what << ": '" << dir.string() << "' is not a directory");
      return;
    }
    if (dir == "." || dir == dir.parent_path()) return;
  }
}

}  // namespace

void check_output_file(const fs::path& path) {
  DETLOGP_CHECK(!path.empty(), "cannot write a file with an empty name");
  std::error_code ec;
  DETLOGP_CHECK(!fs::is_directory(path, ec), "cannot write '" << path.string() << "': it is a directory");
  check_nearest_existing_ancestor(path, "cannot write '" + path.string() + "'");
}

void ensure_directory(const fs::path& dir) {
  std::error_code ec;
  if (fs::is_directory(dir, ec)) return;
  const std::string what = "cannot create directory '" + dir.string() + "'";
  DETLOGP_CHECK(!fs::exists(dir, ec), what << ": it exists and is not a directory");
  check_nearest_existing_ancestor(dir, what);
  fs::create_directories(dir, ec);
  DETLOGP_CHECK(!ec, what << ": " << ec.message());
}

void write_file_atomically(const fs::path& path, std::span<const uint8_t> bytes) {
  check_output_file(path);
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  ensure_directory(dir);
  std::string tmp_name = ".";
  tmp_name += path.filename().string();
  tmp_name += ".tmp-";
  tmp_name += std::to_string(static_cast<long>(::getpid()));
  const fs::path tmp = dir / tmp_name;
  std::error_code ec;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    DETLOGP_CHECK(out, "cannot create temporary file '" << tmp.string() << "'");
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      fs::remove(tmp, ec);
      DETLOGP_FAIL("error writing '" << tmp.string() << "' (disk full?)");
    }
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    DETLOGP_FAIL("cannot rename '" << tmp.string() << "' to '" << path.string() << "': " << ec.message());
  }
}

}  // namespace detlogp::io
