// The HTTP server library; its sources land in this folder.
namespace recur {}
