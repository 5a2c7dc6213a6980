// Keeps glog's logging macros in force in a program that includes <glog/logging.h> before
// dtrain's (or libtorch's) headers.
//
// libtorch is built without glog, so the first inclusion of <c10/util/Logging.h> defines
// LOG, LOG_IF, VLOG, VLOG_IF, VLOG_IS_ON, CHECK, DCHECK and DLOG as c10's own macros, which
// replace glog's when glog came first and drop every LOG(INFO) (c10 prints WARNING and above):
// a program's INFO lines vanish without a word. Every public dtrain header includes this file
// last; when glog's header has been seen and c10's macros are in force, it defines those
// macros again on glog's LogMessage, so LOG(INFO) goes through glog whatever the include order.
//
// It includes <c10/util/Logging.h> itself, so c10's definitions happen here, before the
// repair, and a libtorch header included later (guarded) cannot redefine the macros again:
// glog, dtrain, torch; glog, torch, dtrain; dtrain, glog, torch and torch, glog, dtrain all
// leave glog's macros in force. No include guard: it is re-checked at the end of every header
// that includes it. Without glog included it changes nothing. VLOG_IS_ON(n) is glog's
// portable form, FLAGS_v >= n (--vmodule is not consulted). Code that wants c10's macros
// should not include glog.
#include <c10/util/Logging.h>

#if defined(GLOG_LOGGING_H) && defined(C10_UTIL_LOGGING_IS_NOT_GOOGLE_GLOG_H_)
#undef LOG
#define LOG(severity) COMPACT_GOOGLE_LOG_##severity.stream()
#undef LOG_IF
#define LOG_IF(severity, condition) !(condition) ? (void)0 : google::LogMessageVoidify() & LOG(severity)
#undef VLOG_IS_ON
#define VLOG_IS_ON(verboselevel) (FLAGS_v >= (verboselevel))
#undef VLOG
#define VLOG(verboselevel) LOG_IF(INFO, VLOG_IS_ON(verboselevel))
#undef VLOG_IF
#define VLOG_IF(verboselevel, condition) LOG_IF(INFO, (condition) && VLOG_IS_ON(verboselevel))
#undef CHECK
#define CHECK(condition) LOG_IF(FATAL, !(condition)) << "Check failed: " #condition " "
#undef DCHECK
#undef DLOG
#ifdef NDEBUG
#define DCHECK(condition) \
  while (false) CHECK(condition)
#define DLOG(severity) true ? (void)0 : google::LogMessageVoidify() & LOG(severity)
#else
#define DCHECK(condition) CHECK(condition)
#define DLOG(severity) LOG(severity)
#endif
#endif
