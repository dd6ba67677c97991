# Welch two-sample t-test on the sleep data set (Student, 1908).
tt <- t.test(extra ~ group, data = sleep)
cat("t =", round(unname(tt$statistic), 4), "\n")
cat("df =", round(unname(tt$parameter), 4), "\n")
cat("p =", round(tt$p.value, 5), "\n")
