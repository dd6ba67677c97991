# Linear regression of fuel economy on weight (R's built-in mtcars data set).
fit <- lm(mpg ~ wt, data = mtcars)
print(round(coef(fit), 4))
cat("R^2:", round(summary(fit)$r.squared, 4), "\n")
