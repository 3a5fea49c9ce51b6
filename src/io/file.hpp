// Files on disk for the tensor readers and writers: a read-only memory map of an input file, so
// a multi-GB weight is used where it lies and its pages count once; the checks that say what is
// wrong with an input or output path; atomic writes that create missing parent directories.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>

namespace detlogp::io {

// Throws detlogp::Error unless `path` names a regular file:
//   "cannot read 'P': no such file", "cannot read 'P': it is a directory",
//   "cannot read 'P': not a regular file", or "cannot read 'P': <the system's reason>".
void check_input_file(const std::filesystem::path& path);

// The whole file mapped read-only (PROT_READ, MAP_PRIVATE): pages are read from the file on first
// touch and shared with the page cache, nothing is copied. An empty file maps to an empty span.
// The file must not be truncated while mapped (reading a vanished page raises SIGBUS).
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const uint8_t> bytes() const { return {static_cast<const uint8_t*>(base_), size_}; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  void* base_ = nullptr;
  size_t size_ = 0;
};

// Throws detlogp::Error unless a file can be written at `path`: it is not an existing directory,
// and its nearest existing ancestor is a directory (missing directories below it are created by
// write_file_atomically). Lets a command refuse a bad output path before any work.
void check_output_file(const std::filesystem::path& path);

// mkdir -p: `dir` and its missing parents; the error names the directory that could not be made.
void ensure_directory(const std::filesystem::path& dir);

// Creates the missing parent directories, writes to a temporary file next to `path`, then renames
// it over `path`: readers see the old file or the complete new one, and a failed write leaves no
// file behind.
void write_file_atomically(const std::filesystem::path& path, std::span<const uint8_t> bytes);

}  // namespace detlogp::io
