// hbmio.Error and its subclasses: one per errno value Python has its own OSError subclass for, and,
// where safetensors is installed, subclasses of its SafetensorError too; the translation of the
// library's errors into them.
#include "binding.hpp"

namespace hbmio_py {

PyObject* g_error_type = nullptr;  // hbmio.Error (a subclass of OSError); lives as long as the module
PyObject* g_not_verified_type = nullptr;  // hbmio.NotVerifiedWarning (a UserWarning), held by the module
PyObject* g_verify_error_type = nullptr;  // hbmio.VerifyError (a subclass of hbmio.Error), held by the module

// Subclasses of hbmio.Error that are also the OSError subclass Python itself raises for an errno
// value (FileNotFoundError for ENOENT, ...): code written for safetensors or open() catches
// FileNotFoundError, code written for hbmio catches hbmio.Error, and both catch the same failure.
struct ErrnoType {
  int err;
  const char* name;    // hbmio.<name>
  PyObject** builtin;  // the second base (the address: Python's exception objects are set at run time)
  PyObject* type = nullptr;  // made at module init; EACCES and EPERM share one
};
ErrnoType g_errno_types[] = {
    {ENOENT, "FileNotFoundError", &PyExc_FileNotFoundError},
    {EACCES, "PermissionError", &PyExc_PermissionError},
    {EPERM, "PermissionError", &PyExc_PermissionError},
    {EISDIR, "IsADirectoryError", &PyExc_IsADirectoryError},
    {ENOTDIR, "NotADirectoryError", &PyExc_NotADirectoryError},
    {EEXIST, "FileExistsError", &PyExc_FileExistsError},
};
// The Python type for an error: hbmio.Error, or its subclass for the errno value.
PyObject* error_type_for(int err) {
  for (const auto& t : g_errno_types)
    if (t.err == err) return t.type;
  return g_error_type;
}

// A subclass of hbmio.Error (and of `also`, where not null) that is, where safetensors is
// installed, a safetensors.SafetensorError too, which is what the reference raises for the same
// failure: code written for it (`except SafetensorError`) catches hbmio's too. Made at first use,
// so that safetensors is imported only when such an error happens; hbmio.Error where it cannot be.
PyObject* reference_error_type(const char* name, PyObject* also, const char* doc) {
  nb::list bases;
  bases.append(nb::handle(g_error_type));
  if (also != nullptr) bases.append(nb::handle(also));
  if (PyObject* module = PyImport_ImportModule("safetensors")) {
    if (PyObject* reference = PyObject_GetAttrString(module, "SafetensorError")) bases.append(nb::steal(reference));
    Py_DECREF(module);
  }
  PyErr_Clear();  // without safetensors: no third base
  PyObject* type = PyErr_NewExceptionWithDoc(name, doc, nb::tuple(bases).ptr(), nullptr);
  if (type == nullptr) {
    PyErr_Clear();
    return g_error_type;
  }
  return type;
}

// hbmio.HeaderError: a malformed safetensors header or index.
PyObject* header_error_type() {
  static PyObject* type = nullptr;  // lives as long as the process, as the module's types do
  if (type == nullptr)
    type = reference_error_type("hbmio.HeaderError", nullptr,
                                "A malformed safetensors header or index (hbmio.Error; also safetensors.SafetensorError "
                                "where safetensors is installed).");
  return type;
}

// hbmio.DtypeError: a tensor whose dtype the binding cannot hand out (F6_*) or take (a scalar
// float4_e2m1fn_x2), or an F4 shape torch cannot hold. A TypeError, as hbmio raised for a dtype
// before, and a SafetensorError, as the reference raises for these ("Dtype not understood: ...").
PyObject* dtype_error_type() {
  static PyObject* type = nullptr;
  if (type == nullptr)
    type = reference_error_type("hbmio.DtypeError", PyExc_TypeError,
                                "A dtype or shape of a tensor that cannot be converted (hbmio.Error and TypeError; also "
                                "safetensors.SafetensorError where safetensors is installed).");
  return type;
}

// Raises `type`(args) with hbmio's attributes; a failure of the constructor stays set instead.
void raise_error(PyObject* type, nb::object args, const hbmio::Error* e) {
  PyObject* instance = PyObject_CallObject(type, args.ptr());
  if (!instance) return;
  nb::object inst = nb::steal(instance);
  if (e != nullptr) {
    nb::setattr(inst, "op", nb::str(e->context().op.c_str()));
    nb::setattr(inst, "path", nb::str(e->context().path.c_str()));
    nb::setattr(inst, "backend", nb::str(e->context().backend.c_str()));
    nb::setattr(inst, "detail", nb::str(e->detail().c_str()));
    // OSError.filename, as open() sets it: what `except FileNotFoundError as e: e.filename` reads.
    if (!e->context().path.empty()) nb::setattr(inst, "filename", nb::str(e->context().path.c_str()));
  }
  PyErr_SetObject(type, instance);
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const hbmio::Error& e) {
    const auto& category = e.code().category();
    // errno where the code is one, or maps to one (default_error_condition: a category of
    // hbmio's own may say which errno value its code stands for); None for CUDA and cuFile codes.
    int err = 0;
    if (category == std::generic_category() || category == std::system_category()) {
      err = e.code().value();
    } else if (const auto condition = e.code().default_error_condition(); condition.category() == std::generic_category()) {
      err = condition.value();
    }
    // A failed verification is a finding about the data, which callers tell apart from a failed
    // read: its own type (errno stays EIO, what the category maps it to).
    const bool verify_failed =
        category == hbmio::hbmio_category() && e.code().value() == static_cast<int>(hbmio::Errc::verify_failed);
    const bool malformed = e.context().op.starts_with("parse safetensors");
    PyObject* type = verify_failed                ? g_verify_error_type
                     : malformed                  ? header_error_type()
                     : e.context().op == kDtypeOp ? dtype_error_type()
                     : err != 0                   ? error_type_for(err)
                                                  : g_error_type;
    std::string text = e.what();
    if (err == ENOENT && e.context().op == "open checkpoint") {
      // The reference's words for a missing checkpoint ("No such file or directory: notafile"),
      // which code written for it matches on; the file is named as the caller named it.
      text = std::generic_category().message(ENOENT) + ": " + e.context().path;
      if (!e.detail().empty()) text += " (" + e.detail() + ")";
    }
    nb::object args = err != 0 ? nb::make_tuple(err, text) : nb::make_tuple(text);
    raise_error(type, args, &e);
  } catch (const std::system_error& e) {
    // std::thread's failure (EAGAIN) said only "Resource temporarily unavailable".
    if (e.code() != std::errc::resource_unavailable_try_again) throw;
    raise_error(g_error_type, nb::make_tuple(e.code().value(), hbmio::thread_limit_message(e)), nullptr);
  }
}

// hbmio.Error.__str__: "[Errno N] message" without OSError's ": 'filename'" tail (the message
// names the file already), and the message alone where there is no errno.
PyObject* error_str(PyObject* self, PyObject*) {
  nb::handle h(self);
  nb::object err = nb::getattr(h, "errno", nb::none());
  nb::object text = nb::getattr(h, "strerror", nb::none());
  if (!err.is_none() && !text.is_none()) return PyUnicode_FromFormat("[Errno %S] %S", err.ptr(), text.ptr());
  nb::tuple args = nb::borrow<nb::tuple>(nb::getattr(h, "args"));
  if (args.size() == 1) return PyObject_Str(args[0].ptr());
  return reinterpret_cast<PyTypeObject*>(PyExc_OSError)->tp_str(self);
}
PyMethodDef g_error_str_def = {"__str__", error_str, METH_NOARGS, nullptr};

// Makes hbmio.Error, hbmio.VerifyError and the errno subclasses, as attributes of `m`.
void make_error_types(nb::module_& m) {
  g_error_type = PyErr_NewExceptionWithDoc(
      "hbmio.Error",
      "An hbmio failure: the C++ message (operation, file, offset, backend, system message). A subclass of "
      "OSError; errno is set when the failure has an errno value (None for CUDA and cuFile codes), and "
      "filename to the file it concerns. Where Python has an OSError subclass for the errno value, the "
      "error is also one: hbmio.FileNotFoundError is both hbmio.Error and FileNotFoundError (likewise "
      "PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError).",
      PyExc_OSError, nullptr);
  if (g_error_type == nullptr) throw nb::python_error();
  PyObject* str = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(g_error_type), &g_error_str_def);
  if (str == nullptr || PyObject_SetAttrString(g_error_type, "__str__", str) != 0) throw nb::python_error();
  Py_DECREF(str);
  m.attr("Error") = nb::handle(g_error_type);
  // A type named hbmio.NAME with `bases` (a type or a tuple of them), held by the module as long as
  // it lives; the raw pointer is what the translator raises.
  const auto make_type = [&m](const char* name, const char* doc, PyObject* bases) {
    const std::string qualified = std::string("hbmio.") + name;
    PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
    if (type == nullptr) throw nb::python_error();
    m.attr(name) = nb::steal(type);
    return type;
  };
  g_verify_error_type = make_type(
      "VerifyError",
      "hbmio.Error for a verification that failed: a stored checksum, a byte comparison or a header check "
      "did not match what was read (verify=True). errno is EIO.",
      g_error_type);
  g_not_verified_type = make_type(
      "NotVerifiedWarning",
      "verify=True loaded files that hold no hbmio checksums (any file another tool wrote): their tensors "
      "were not checked. verify=\"strict\" refuses such files instead.",
      PyExc_UserWarning);
  for (auto& t : g_errno_types) {
    if (nb::hasattr(m, t.name)) {  // EPERM: the type made for EACCES
      t.type = m.attr(t.name).ptr();
      continue;
    }
    nb::tuple bases = nb::make_tuple(nb::handle(g_error_type), nb::handle(*t.builtin));
    const std::string doc = std::string("hbmio.Error that is also ") + t.name + ".";
    t.type = make_type(t.name, doc.c_str(), bases.ptr());
  }
}

void bind_errors(nb::module_& m) {
  make_error_types(m);
  nb::register_exception_translator(translate);
}

}  // namespace hbmio_py
