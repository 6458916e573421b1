// The private-directory rule (private_dir.h) for Python: each call hands back a descriptor that
// the caller owns and closes. Paths come as the file system's bytes (os.fsencode), names as text.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "call_without_gil.h"
#include "fanrun/private_dir.h"
#include "status_to_python.h"

namespace nb = nanobind;

namespace fanrun::bindings {
namespace {

std::string PathOf(const nb::bytes& path) { return std::string(path.c_str(), path.size()); }

}  // namespace

void BindPrivateDir(nb::module_& m) {
  m.def(
      "open_private_dir",
      [](const nb::bytes& path, const std::string& what, const std::string& remedy) {
        const std::string opened = PathOf(path);
        const DirectoryDescription description{what, remedy};
        return CallWithoutGil([&] { return OpenPrivateDirectory(opened, description); }).fd.Release();
      },
      nb::arg("path"), nb::kw_only(), nb::arg("what"), nb::arg("remedy"),
      "A descriptor of the directory `path` (O_DIRECTORY, close-on-exec), made with every missing\n"
      "directory above it (0700) and checked by the rule on the way down; UnsafePathError where it\n"
      "is not the caller's alone. `what` names it in errors (\"The cache directory\"), `remedy` says what\n"
      "to do instead.");
  m.def(
      "open_private_subdir",
      [](int parent_fd, const std::string& name, const nb::bytes& parent_path, const std::string& what,
         const std::string& remedy) {
        const std::string parent = PathOf(parent_path);
        const DirectoryDescription description{what, remedy};
        return CallWithoutGil([&] { return OpenPrivateSubdirectory(parent_fd, parent, name, description); }).Release();
      },
      nb::arg("parent_fd"), nb::arg("name"), nb::arg("parent_path"), nb::kw_only(), nb::arg("what"), nb::arg("remedy"),
      "A descriptor of the subdirectory `name` of the private directory open at parent_fd (named\n"
      "parent_path in errors), made 0700 where missing, checked as the directory itself; one of\n"
      "fanrun's own found with a wider mode is narrowed to 0700.");
  m.def(
      "open_private",
      [](int dir_fd, const std::string& name, int flags) {
        return CallWithoutGil([&] { return OpenPrivateFile(dir_fd, name, flags); }).Release();
      },
      nb::arg("dir_fd"), nb::arg("name"), nb::arg("flags"),
      "Opens the file `name` of the directory open at dir_fd with os.open's `flags`, never through a\n"
      "link; a file it creates is 0600. Returns the descriptor (close-on-exec) only if it is a regular\n"
      "file of the caller's that nobody else can read or write; UnsafePathError otherwise.");
}

}  // namespace fanrun::bindings
