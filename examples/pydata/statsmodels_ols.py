# Ordinary least squares of fuel economy on weight (mtcars.csv); matches R's
# coef(lm(mpg ~ wt, data = mtcars)): 37.2851, -5.3445, R^2 0.7528.
import pandas as pd
import statsmodels.formula.api as smf

mtcars = pd.read_csv("mtcars.csv")
fit = smf.ols("mpg ~ wt", data=mtcars).fit()
print(fit.params.round(4).to_string())
print("R^2:", round(fit.rsquared, 4))
