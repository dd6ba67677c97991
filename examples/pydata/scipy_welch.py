# Welch two-sample t-test on R's sleep data set (uploaded as sleep.csv); matches R's
# t.test(extra ~ group, data = sleep): t = -1.8608, df = 17.7765, p = 0.07939.
import pandas as pd
from scipy import stats

sleep = pd.read_csv("sleep.csv")
a = sleep.loc[sleep.group == 1, "extra"]
b = sleep.loc[sleep.group == 2, "extra"]
res = stats.ttest_ind(a, b, equal_var=False)
va, vb = a.var() / len(a), b.var() / len(b)
df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
print(f"t = {res.statistic:.4f}")
print(f"df = {df:.4f}")
print(f"p = {res.pvalue:.4g}")
