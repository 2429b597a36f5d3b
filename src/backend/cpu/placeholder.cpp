namespace recur {}
